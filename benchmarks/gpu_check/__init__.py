"""One command that measures every GPU claim of the project and checks it against its target.

    bash scripts/gpu-check.sh OUT             # on a node with one or more NVIDIA GPUs
    bash scripts/gpu-check.sh --dry-run OUT   # anywhere: the same steps on CPU, tiny sizes

The shell script installs what the GPU node lacks from carried wheels (``scripts/gpu-wheels.sh``;
never torch: the node's CUDA build is used as it is) and runs ``python -m benchmarks.gpu_check``.
That checks the node (:mod:`.node`), runs each step of :data:`~benchmarks.gpu_check.plan.STEPS`
(the ``gpu``-marked tests and the benchmarks whose commands ``benchmarks/RESULTS.md`` records)
under its own time limit (:mod:`.runner`), parses
each step's output (:mod:`.parsers`), and ends with one table: claim, CPU figure (from RESULTS.md),
GPU figure, target, pass/fail (:mod:`.report`). ``OUT`` receives ``table.md``, ``results.json``
and one raw log per step. The exit status is non-zero when a target is missed or a step fails;
in a dry run only when a step fails (tiny CPU runs say nothing about GPU targets).

Invariants: the whole GPU run fits in :data:`~benchmarks.gpu_check.plan.BUDGET_S` (9.5 minutes on
one H100, set-up excluded), because every step is killed at its limit and no step starts past the
budget; every claim of :data:`~benchmarks.gpu_check.plan.CLAIMS` is a row of the table whatever
happened (not run, skipped, failed, not built yet). Adding a measurement is one
:class:`~benchmarks.gpu_check.plan.Step`, one parser and one or more
:class:`~benchmarks.gpu_check.plan.Claim` rows (the sharded-model rows wait for exactly that).
How to use it: ``docs/gpu-check.md``.
"""
