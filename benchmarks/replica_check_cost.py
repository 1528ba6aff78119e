"""What the replica-divergence check costs a step, by parts, in CPU time (issue 40).

    python -m benchmarks.replica_check_cost                       # MLP 1024 and the decoder
    python -m benchmarks.replica_check_cost --workloads mlp1024 --repeats 100

On this shared 2-core machine a launcher A/B swings +-10 %, too much to resolve a fraction of a
per cent, so the cost is measured in its parts and put together. For each workload of
``benchmarks/launcher_e2e.py`` (its options, the model that ``benchmarks/launcher_job.py`` builds
from them) one process with one torch thread, as a worker runs, times alternately, with
``time.process_time`` (CPU) and ``time.perf_counter`` (wall), medians over ``--repeats``:

- a check: :meth:`~elastic_trainer.train.replica_check.ReplicaCheck.after_update` at a step where
  it is due (the real object on a real ``TrainingState``: ``state_checksum`` of every parameter),
  then ``take`` and ``checksum_bits``, the 16 bits the control carries;
- a training step at the run's per-rank batch (the job's loss, SGD with momentum: forward,
  backward, update, ``loss.item()``), single process, no DDP: the gradient allreduce and the
  runtime's own work are left out, so the step is cheaper than a worker's and the ratio an upper
  bound.

The cost per step is ``check / step x checks / steps``: ``1/N`` in steady state
(``ELASTIC_TRAINER_REPLICA_CHECK_EVERY``, default 100), the two checks after every start, resume
or heal, and the checks that fall inside ``launcher_e2e``'s steady window (after steps 1, 2 and
every ``N``th; a window is steps ``warmup+1..steps``).

No collective is added, and none is timed: the checksum's 16 bits and the "checked" flag have
fixed slots in the step's control header (``runtime/control_header.py``: ``CHECKED`` and
``CHECK_BITS``; ``runtime/step_control.py``: ``ControlChannel.start`` writes them), which travels
every step whether a check is due or not (zeros when not; with the check off too), aboard DDP's
gradient bucket on the CPU or on the control's own allreduce otherwise. Those 17 slots (float32 in
a bucket of millions of values, float64 beside 4 others on the own allreduce) are in every step
of both arms of any A/B; ``ReplicaCheck.compared`` reads them back in Python once per check.
Results: ``benchmarks/RESULTS.md``; design: ``docs/design/own-loop.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.data import default_collate

from benchmarks import launcher_e2e
from benchmarks.launcher_job import _job
from benchmarks.workloads import train_step

NPROC = 2
"""Workers of a ``launcher_e2e`` run on the CPU: the per-rank batch is the global batch over it."""
DEFAULT_WORKLOADS = ("mlp1024", "gpt")
_JOB_SIZES = ("width", "seq_len", "layers", "d_model", "vocab")


def _options(workload: str) -> dict[str, str]:
    """``launcher_e2e``'s options of ``workload`` for ``launcher_job.py``, by attribute name."""
    line = launcher_e2e.workload_args(workload, device="cpu", nproc=NPROC, tiny=False)
    return {
        k.removeprefix("--").replace("-", "_"): v
        for k, v in zip(line[::2], line[1::2], strict=True)
    }


def _timed(action: Callable[[], object]) -> tuple[float, float]:
    """(CPU s, wall s) of one call."""
    cpu, wall = time.process_time(), time.perf_counter()
    action()
    return time.process_time() - cpu, time.perf_counter() - wall


def checks_in(first: int, last: int, every: int) -> int:
    """Checks after steps ``first..last`` of a run started at step 0 (``ReplicaCheck``'s rule)."""
    return sum(1 for step in range(first, last + 1) if step <= 2 or step % every == 0)


def measure(workload: str, repeats: int, warmup: int, every: int) -> dict[str, float | int | str]:
    """One workload: medians of a check and of a step, and the counts of its params and checks."""
    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.state.training_state import TrainingState
    from elastic_trainer.train.replica_check import ReplicaCheck

    options = _options(workload)
    per_rank = int(options["global_batch_size"]) // NPROC
    # The model's sizes are the run's (the other model's: None); the data, one batch.
    sizes = {k: int(options[k]) if k in options else None for k in _JOB_SIZES}
    args = argparse.Namespace(model=options["model"], dataset_size=per_rank, **sizes)
    torch.manual_seed(0)
    job = _job(args)
    model = job.model()
    data = job.dataset()
    inputs, target = default_collate([data[i] for i in range(per_rank)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    env = read_env(
        environ={"RANK": "0", "WORLD_SIZE": str(NPROC), "LOCAL_RANK": "0"}, cuda_devices=0
    )
    check = ReplicaCheck(TrainingState({"model": model}, env=env), env, every=every)
    check.started(0)

    def one_check() -> None:
        check.after_update(every)  # a due step: the checksum of every parameter
        taken = check.take()
        if taken is None:
            raise RuntimeError("ReplicaCheck took no checksum at a due step")

    def one_step() -> None:
        train_step(job, model, optimizer, inputs, target, contextlib.nullcontext)

    for _ in range(warmup):
        one_step()
        one_check()
    steps, checks, idle = [], [], []
    for _ in range(repeats):
        steps.append(_timed(one_step))
        checks.append(_timed(one_check))
        idle.append(_timed(lambda: check.after_update(every + 1)))  # not due: the per-step test
    steps_total, warm = int(options["steps"]), int(options["warmup"])
    return {
        "workload": workload,
        "params": sum(p.numel() for p in model.parameters()),
        "per_rank": per_rank,
        "step_cpu": statistics.median(c for c, _ in steps),
        "step_wall": statistics.median(w for _, w in steps),
        "check_cpu": statistics.median(c for c, _ in checks),
        "check_wall": statistics.median(w for _, w in checks),
        "idle_cpu": statistics.median(c for c, _ in idle),
        "run_steps": steps_total,
        "run_checks": checks_in(1, steps_total, every),
        "window_steps": steps_total - warm,
        "window_checks": checks_in(warm + 1, steps_total, every),
    }


def report(rows: list[dict[str, float | int | str]], every: int) -> str:
    """The table, then each workload's cost per step as a percentage of the step's CPU time."""
    lines = [
        f"{'workload':<9} {'params':>10} {'batch':>5} {'step CPU ms':>11} {'wall':>7} "
        f"{'check CPU ms':>12} {'wall':>7} {'not due us':>10}"
    ]
    for r in rows:
        lines.append(
            f"{r['workload']:<9} {r['params']:>10,} {r['per_rank']:>5} {1e3 * float(r['step_cpu']):>11.2f} "
            f"{1e3 * float(r['step_wall']):>7.2f} {1e3 * float(r['check_cpu']):>12.2f} "
            f"{1e3 * float(r['check_wall']):>7.2f} {1e6 * float(r['idle_cpu']):>10.1f}"
        )
    lines.append("")
    for r in rows:
        ratio = float(r["check_cpu"]) / float(r["step_cpu"])  # a check in steps
        wall = float(r["check_wall"]) / float(r["step_wall"])
        lines.append(
            f"{r['workload']}: a check = {ratio:.3f} step (wall {wall:.3f}); steady, 1 per {every} "
            f"steps: {100 * ratio / every:.3f} % of a step's CPU (wall {100 * wall / every:.3f} %); "
            f"the 2 after a start: {2 * ratio:.2f} step; launcher_e2e's run "
            f"({r['run_checks']} in {r['run_steps']} steps): {100 * ratio * int(r['run_checks']) / int(r['run_steps']):.3f} %, "
            f"its steady window ({r['window_checks']} in {r['window_steps']}): "
            f"{100 * ratio * int(r['window_checks']) / int(r['window_steps']):.3f} %"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from elastic_trainer.runtime.settings import DEFAULT_REPLICA_CHECK_EVERY

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=tuple(launcher_e2e.WORKLOADS),
                        default=list(DEFAULT_WORKLOADS))  # fmt: skip
    parser.add_argument("--repeats", type=int, default=60, help="timed steps and checks (medians)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps and checks first")
    parser.add_argument(
        "--every",
        type=int,
        default=DEFAULT_REPLICA_CHECK_EVERY,
        help="steps between checks (ELASTIC_TRAINER_REPLICA_CHECK_EVERY's default)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.every < 1:
        parser.exit(2, "replica_check_cost: --repeats and --every must be at least 1\n")
    torch.set_num_threads(1)  # as launcher_job.py's workers
    load = os.getloadavg()
    rows = [measure(w, args.repeats, args.warmup, args.every) for w in args.workloads]
    print(
        f"replica check, one process, 1 torch thread, no DDP, medians of {args.repeats}; "
        f"load {load[0]:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print(report(rows, args.every))


if __name__ == "__main__":
    main()
