"""What the GPU check runs and what it checks: the steps (commands, time limits) and the claims
(rows of the table: CPU figure from ``benchmarks/RESULTS.md``, target).

The GPU commands are the ones RESULTS.md records for the next GPU session, sized so that the
limits add up to :data:`BUDGET_S`; each dry-run command is the same program on CPU with tiny
sizes. To add a measurement: a :class:`Step` in :data:`STEPS`, its parser in :mod:`.parsers`,
and a :class:`Claim` naming the step and a figure of the parser (a claim with no step yet is a
``not built yet`` row). A claim's CPU figure is text copied from
RESULTS.md with its source in ``cpu_source``: update both when RESULTS.md records a newer figure.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.gpu_check import parsers

BUDGET_S = 570.0  # the GPU run, set-up excluded; with a machine's start, a 15-minute lease
DRY_BUDGET_S = 480.0  # the CPU dry run: ~45 s of CPU, 50 s on 2 quiet cores; the limits catch hangs

# The dry run's GPT: the GPU model's code path (DecoderLM, the LM loss) at a size a CPU steps fast.
_TINY_GPT = ("--model", "gpt", "--layers", "1", "--d-model", "32", "--vocab", "256",
             "--seq-len", "16", "--global-batch-size", "4", "--dataset-size", "64")  # fmt: skip
# Through the real launchers (issue 30): the claim; e2e_gpt and e2e_cnn explain it in-process.
_LAUNCHER = ("-m", "benchmarks.launcher_e2e", "--workloads", "gpt", "--variants", "bare/torchrun", "trainer/elastic",
             "--json", "{out}/launcher_gpt.jsonl")  # fmt: skip
_METRICS_GPU = ("-m", "benchmarks.metrics_overhead", "--device", "cuda", "--model", "gpt", "--cycles", "300",
                "--warmup", "20", "--rebuild-every", "100", "--repeat", "1")  # fmt: skip
_METRICS_DRY = ("-m", "benchmarks.metrics_overhead", *_TINY_GPT, "--cycles", "20", "--warmup", "4",
                "--rebuild-every", "10", "--repeat", "1", "--skip-micro")  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """One command of the check, run by the Python that runs the check."""

    name: str
    """Identifier; the raw log is ``OUT/<name>.log``."""
    gpu: tuple[str, ...]
    """Arguments after ``python`` on a GPU node; ``{out}`` stands for the output folder."""
    dry: tuple[str, ...]
    """Arguments after ``python`` in the dry run: the same program on CPU, tiny sizes."""
    limit_s: float
    """Time limit on a GPU node; the step is killed at it."""
    dry_limit_s: float
    """Time limit in the dry run."""
    parse: parsers.Parser
    """Reads the figures from the step's output (see :mod:`.parsers`)."""
    min_gpus: int = 1
    """GPUs the GPU command needs; with fewer the step is skipped (never in the dry run)."""
    gpus_why: str = ""
    """Why it needs ``min_gpus``: shown with the skip."""
    ok_returncodes: tuple[int, ...] = (0,)
    """Exit codes after which the output is read (pytest exits 1 when a test fails)."""
    artifacts: tuple[str, ...] = ()
    """Files the step writes into the output folder, removed before it runs (no stale figures)."""

    def __post_init__(self) -> None:
        if not self.name.replace("_", "").isalnum():
            raise ValueError(f"name: {self.name!r} is not a plain identifier (it names a log file)")
        if self.limit_s <= 0 or self.dry_limit_s <= 0:
            raise ValueError(f"limit_s / dry_limit_s of {self.name}: must be positive")
        if self.min_gpus < 1:
            raise ValueError(f"min_gpus of {self.name}: must be at least 1")

    def argv(self, *, dry_run: bool, out: Path) -> list[str]:
        """The arguments after ``python``, ``{out}`` filled in."""
        return [a.replace("{out}", str(out)) for a in (self.dry if dry_run else self.gpu)]


_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Target:
    """``figure <op> value``, e.g. ``Target(">=", 0.99)``; ``text`` replaces the shown form."""

    op: str
    value: float
    text: str = ""

    def __post_init__(self) -> None:
        if self.op not in _COMPARE:
            raise ValueError(f"op: expected one of {sorted(_COMPARE)}, got {self.op!r}")

    def met(self, figure: float) -> bool:
        """Whether ``figure`` meets the target (NaN never does)."""
        return figure == figure and _COMPARE[self.op](figure, self.value)

    def __str__(self) -> str:
        return self.text or f"{self.op} {self.value:g}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Claim:
    """One row of the table."""

    claim: str
    """What is claimed, in a few words."""
    step: str | None
    """The step that measures it; ``None``: not built yet (the row says so and never fails)."""
    figure: str = ""
    """The name of the step's figure (a key of its parser's result)."""
    cpu: str = "n/a"
    """The CPU figure, as benchmarks/RESULTS.md has it."""
    cpu_source: str = ""
    """Where in RESULTS.md the CPU figure comes from (a footnote of the table)."""
    target: Target | None = None
    """What the GPU figure must meet; ``None`` only for rows not built yet."""

    def __post_init__(self) -> None:
        if self.step is not None and (not self.figure or self.target is None):
            raise ValueError(f"claim {self.claim!r}: a measured claim needs figure and target")


@dataclass(frozen=True, slots=True)
class Plan:
    """The steps and the rows of one check."""

    steps: tuple[Step, ...]
    claims: tuple[Claim, ...]
    budget_s: float
    dry_budget_s: float
    by_name: dict[str, Step] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {s.name: s for s in self.steps})
        if len(self.by_name) != len(self.steps):
            raise ValueError("steps: two steps share a name")
        for claim in self.claims:
            if claim.step is not None and claim.step not in self.by_name:
                raise ValueError(f"claim {claim.claim!r}: no step named {claim.step!r}")


_TESTS_TARGET = Target("==", 0, "all pass (a 2-GPU test may skip)")

STEPS: tuple[Step, ...] = (
    Step(name="gpu_tests",
         gpu=("-m", "pytest", "-p", "no:cacheprovider", "tests/gpu", "-m", "gpu", "-q", "-rs",
              "--junitxml", "{out}/" + parsers.GPU_TESTS_XML),
         dry=("-m", "pytest", "-p", "no:cacheprovider", "tests/gpu", "-m", "gpu", "-q", "-rs",
              "--junitxml", "{out}/" + parsers.GPU_TESTS_XML),
         limit_s=140, dry_limit_s=120, parse=parsers.gpu_tests, ok_returncodes=(0, 1),
         artifacts=(parsers.GPU_TESTS_XML,)),
    # 3 pairs of GPT-2 small, 90 steps a run (~3 s of steps on an H100 after a start of ~7 s, estimated:
    # not run on a GPU yet); the dry run: 1 pair, 1 worker, a toy decoder (--tiny: fewer than 3 pairs).
    Step(name="launcher_gpt", gpu=(*_LAUNCHER, "--device", "cuda", "--pairs", "3"),
         dry=(*_LAUNCHER, "--tiny", "--pairs", "1", "--nproc", "1"), limit_s=90, dry_limit_s=60,
         parse=parsers.launcher_e2e, artifacts=("launcher_gpt.jsonl",)),
    Step(name="e2e_gpt",
         gpu=("-m", "benchmarks.overhead_e2e", "--device", "cuda", "--model", "gpt", "--blocks", "4", "--steps", "100"),
         dry=("-m", "benchmarks.overhead_e2e", *_TINY_GPT, "--blocks", "1", "--steps", "5", "--warmup", "3"),
         limit_s=65, dry_limit_s=120, parse=parsers.overhead_e2e),
    Step(name="e2e_cnn",
         gpu=("-m", "benchmarks.overhead_e2e", "--device", "cuda", "--model", "cnn", "--blocks", "4", "--steps", "200"),
         dry=("-m", "benchmarks.overhead_e2e", "--model", "cnn", "--width", "8", "--dataset-size", "512",
              "--blocks", "1", "--steps", "5", "--warmup", "3"),
         limit_s=30, dry_limit_s=120, parse=parsers.overhead_e2e),
    # Metrics off vs on, DDP's buckets in C++ either way: sampled (the default) and trace. The removed
    # hook mode's GPU figure is in RESULTS (0.93-0.96, session 5).
    Step(name="metrics_sampled", gpu=_METRICS_GPU, dry=_METRICS_DRY, limit_s=50, dry_limit_s=120,
         parse=parsers.metrics_overhead),
    Step(name="metrics_trace", gpu=(*_METRICS_GPU, "--trace"), dry=(*_METRICS_DRY, "--trace"), limit_s=50,
         dry_limit_s=120, parse=parsers.metrics_overhead),
    Step(name="checkpoint_stall",
         gpu=("-m", "benchmarks.checkpoint_stall", "--steps", "40", "--every", "10", "--repeats", "1"),
         dry=("-m", "benchmarks.checkpoint_stall", "--steps", "4", "--every", "2", "--repeats", "1", "--dim", "256",
              "--layers", "2"),
         limit_s=40, dry_limit_s=120, parse=parsers.checkpoint_stall),
    # Sharded (FSDP2) state on NCCL, one rank per GPU (at most two; one GPU: a 1-rank mesh).
    Step(name="sharded_stall",
         gpu=("-m", "benchmarks.sharded_checkpoint", "stall", "--device", "cuda", "--dim", "4096", "--layers", "8",
              "--steps", "24", "--every", "8", "--repeats", "1"),
         dry=("-m", "benchmarks.sharded_checkpoint", "stall", "--dim", "64", "--layers", "1", "--steps", "2",
              "--every", "1", "--repeats", "1"),
         limit_s=30, dry_limit_s=120, parse=parsers.sharded_stall),
    Step(name="sharded_steady",
         gpu=("-m", "benchmarks.sharded_checkpoint", "steady", "--device", "cuda", "--dim", "2048", "--layers", "8",
              "--batch", "64", "--steps", "200", "--repeats", "2"),
         dry=("-m", "benchmarks.sharded_checkpoint", "steady", "--dim", "64", "--layers", "1", "--steps", "4",
              "--repeats", "1"),
         limit_s=30, dry_limit_s=120, parse=parsers.sharded_steady),
    Step(name="restart_cost",
         gpu=("-m", "benchmarks.restart_cost", "--device", "cuda", "--repeats", "2"),
         dry=("-m", "benchmarks.restart_cost", "--repeats", "1", "--state-mb", "4", "--tensor-mb", "1"),
         limit_s=45, dry_limit_s=120, parse=parsers.restart_cost, min_gpus=2,
         gpus_why="a heal in place on NCCL needs a survivor and a replacement on two GPUs; "
                  "`python -m benchmarks.restart_cost --device cuda` runs on one by hand"),
)  # fmt: skip

CLAIMS: tuple[Claim, ...] = (
    Claim(claim="no device wait in a steady-state step (tests/gpu/test_no_device_wait_cuda.py)",
          step="gpu_tests", figure="test_no_device_wait_cuda", cpu="0 waits",
          cpu_source="tests/unit/test_no_device_wait.py counts them on CPU; RESULTS 'Against the targets' (issue 18)",
          target=_TESTS_TARGET),
    Claim(claim="NCCL: metrics with no comm hook, flight recorder, restart, heal in place (tests/gpu/test_cuda_nccl.py)",
          step="gpu_tests", figure="test_cuda_nccl", target=_TESTS_TARGET),
    Claim(claim="Trainer under elastic-trainer run vs bare DDP under torchrun, GPT-2 small: throughput",
          step="launcher_gpt", figure="wall_ratio", cpu="1.020 / 0.997x",
          cpu_source="issue 30, the decoder (4 blocks, d_model 384), 5 pairs, 305879b: throughput / CPU per step, "
          "`launcher_e2e --pairs 5 --variants bare/torchrun trainer/elastic trainer/elastic+nockpt` (RESULTS, "
          "'The real launchers on a quiet machine')", target=Target(">=", 0.99)),
    Claim(claim="runtime at its defaults vs bare DDP in-process, GPT-2 small bf16: throughput", step="e2e_gpt",
          figure="wall_ratio", cpu="n/a (GPU model)", cpu_source="on an H100 on 2026-11-22 (before steady-state "
          "work): 0.890 (issue 33)", target=Target(">=", 0.98)),
    Claim(claim="runtime at its defaults vs bare DDP, example CNN: throughput", step="e2e_cnn", figure="wall_ratio",
          cpu="1.137", cpu_source="session 14, `overhead_e2e --blocks 4` (RESULTS, issue 18)",
          target=Target(">=", 0.98)),
    Claim(claim="runtime at its defaults vs bare DDP, example CNN: CPU per sample", step="e2e_cnn",
          figure="cpu_ratio", cpu="0.997", cpu_source="session 14, `overhead_e2e --blocks 4` (RESULTS, issue 18)",
          target=Target("<=", 1.05)),
    Claim(claim="metrics on/off, GPT-2 small, sampled mode (the default, no hook): throughput",
          step="metrics_sampled", figure="wall_ratio", cpu="see launcher_e2e",
          cpu_source="issue 30: `benchmarks/launcher_e2e.py` (RESULTS, headline table)", target=Target(">=", 0.99)),
    Claim(claim="metrics on/off, GPT-2 small, trace mode: throughput", step="metrics_trace", figure="wall_ratio",
          cpu="n/a (gloo never times the recorder)", cpu_source="RESULTS, metrics session 6",
          target=Target(">=", 0.99)),
    Claim(claim="async checkpoint stall / sync, 537 MB", step="checkpoint_stall", figure="stall_ratio",
          cpu="0.031", cpu_source="session 12, `checkpoint_stall --steps 40 --every 10 --repeats 2` (RESULTS, "
          "issue 18)", target=Target("<=", 0.05)),
    Claim(claim="restart / heal in place, 200 MB + AdamW state", step="restart_cost", figure="restart_ratio",
          cpu="1.4x", cpu_source="session 9, `restart_cost --repeats 3`: 1.517 s vs 1.087 s (RESULTS, issue 19)",
          target=Target(">", 1.0, "> 1 (in place is cheaper)")),
    Claim(claim="sharded model (FSDP2): library at its defaults vs bare FSDP2: CPU per step",
          step="sharded_steady", figure="cpu_ratio", cpu="1.031-1.062x",
          cpu_source="issue 32, `sharded_checkpoint steady --dim 512 --layers 4 --steps 300 --repeats 3` at load 13 "
          "(RESULTS)", target=Target("<=", 1.03)),
    Claim(claim="sharded model (FSDP2): library at its defaults vs bare FSDP2: throughput", step="sharded_steady",
          figure="wall_ratio", cpu="see CPU row", cpu_source="same run", target=Target(">=", 0.98)),
    Claim(claim="sharded model: async DCP checkpoint stall / sync", step="sharded_stall", figure="stall_ratio",
          cpu="0.035", cpu_source="issue 32, `sharded_checkpoint stall --dim 2048 --layers 8 --steps 24 --every 8 "
          "--repeats 2` (RESULTS)", target=Target("<=", 0.05)),
)  # fmt: skip

PLAN = Plan(steps=STEPS, claims=CLAIMS, budget_s=BUDGET_S, dry_budget_s=DRY_BUDGET_S)
