"""``elastic-trainer doctor``: the DDP debugging checklist, run on every rank, reported once.

Run it under torchrun exactly like a training job, on every node::

    torchrun --standalone --nproc-per-node=2 -m elastic_trainer.doctor --sizes 1K..64M
    elastic-trainer doctor --nproc-per-node=2          # the same through the elastic launcher

:class:`Doctor` runs the local checks, creates the process group, runs the collective checks in
the same order on every rank, gathers the results and has rank 0 print one report (``--json``
for machines). Exit status on every rank: 0 nothing failed, 1 a check failed, 2 bad arguments.
Nothing waits forever: collectives time out after ``--timeout`` and a watchdog ends the process
after ``--deadline``. Self-test: ``ELASTIC_TRAINER_DOCTOR_FAULT``. Design: ``docs/design/doctor.md``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import socket
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic_trainer.doctor import checks
from elastic_trainer.doctor.perf import DEFAULT_SIZES, barrier, parse_sizes
from elastic_trainer.doctor.report import (
    CHECKS,
    FAIL,
    PASS,
    SKIP,
    CheckResult,
    MergedReport,
    RankReport,
    merge,
    render_json,
    render_text,
)
from elastic_trainer.runtime import distributed
from elastic_trainer.runtime.failures import UserError, first_line
from elastic_trainer.runtime.process_exit import exit_process

log = logging.getLogger(__name__)

PROG = "elastic-trainer doctor"
_INT_RANGES = (("iters", 1, 10_000), ("warmup", 0, 10_000), ("batch_size", 1, 65_536))
"""The integer options' names and their inclusive ranges."""

DESCRIPTION = (
    "Run the DDP debugging checklist on every rank, under torchrun, and print one report from "
    f"rank 0 with PASS / WARN / FAIL per check: {'; '.join(CHECKS.values())}."
)

EPILOG = """\
examples:
  torchrun --standalone --nproc-per-node=2 -m elastic_trainer.doctor
  torchrun --standalone --nproc-per-node=2 -m elastic_trainer.doctor --json --sizes 1K,64K --iters 3
  elastic-trainer doctor --nproc-per-node=8 --rdzv-endpoint=etcd:2379 --run-id=doctor-1

exit status: 0 all checks passed (warnings allowed), 1 a check failed, 2 bad arguments.
self-test: ELASTIC_TRAINER_DOCTOR_FAULT=allreduce|grad_sync|placement|hang breaks the last rank on purpose.
"""


_QUIET_RANK_GRACE_S = 10.0
"""How long a non-zero rank with bad arguments waits for the agent to stop it after rank 0 fails."""


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises :class:`UserError` (the doctor reports it on every rank, then exits 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(message)


@dataclass(kw_only=True, slots=True)
class DoctorOptions:
    """What the command line asks for, validated."""

    json: bool = False
    """Print the machine-readable report instead of the text one."""
    sizes: list[int] = field(default_factory=lambda: parse_sizes(DEFAULT_SIZES))
    """Allreduce message sizes in bytes for the bandwidth table."""
    iters: int = 20
    """Timed iterations per measurement."""
    warmup: int = 5
    """Untimed iterations before each measurement."""
    batch_size: int = 32
    """Per-rank batch of the example model for the placement, grad-sync and ratio checks."""
    timeout_s: float = 60.0
    """Collective timeout of the doctor's process group."""
    deadline_s: float = 300.0
    """Hard limit on the whole run; the process exits with a FAIL after it."""
    verbose: bool = False
    """Log debug messages, including the traceback behind a check that crashed."""

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ValueError("sizes: at least one message size is needed")
        for name, low, high in _INT_RANGES:
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{name}: must be in {low}..{high}, got {value}")
        for name in ("timeout_s", "deadline_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(
                    f"{name}: must be a positive number of seconds, got {getattr(self, name)}"
                )
        if not self.deadline_s > self.timeout_s:
            raise ValueError(
                f"deadline_s: must exceed the timeout ({self.timeout_s:g} s), got {self.deadline_s:g}"
            )


def _sizes(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_NUMBERS = (
    ("iters", "--iters", int, "timed iterations per measurement"),
    ("warmup", "--warmup", int, "untimed iterations before each measurement"),
    ("batch_size", "--batch-size", int, "per-rank batch of the example model"),
    ("timeout_s", "--timeout", float, "collective timeout of the doctor's process group"),
    ("deadline_s", "--deadline", float, "hard limit on the whole run"),
)
"""The numeric options: :class:`DoctorOptions` field, flag, type and help (defaults: the field's)."""
_FLAGS = {"sizes": "--sizes"} | {name: flag for name, flag, *_ in _NUMBERS}
"""The flag behind each :class:`DoctorOptions` field, for error messages."""


def build_parser() -> argparse.ArgumentParser:
    parser = _RaisingParser(
        prog=PROG,
        description=textwrap.fill(DESCRIPTION, 100),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, what in (
        ("--json", "print a machine-readable JSON report"),
        ("--verbose", "log debug messages, with the traceback behind a check that crashed"),
    ):
        parser.add_argument(flag, action="store_true", help=what)
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=DEFAULT_SIZES,
        metavar="MIN..MAX[:F] | S1,S2,...",
        help=f"allreduce message sizes: a range that multiplies by F (default 2) or a list; "
        f"units K, M, G (binary) (default {DEFAULT_SIZES})",
    )
    defaults = DoctorOptions()
    for name, flag, kind, what in _NUMBERS:
        parser.add_argument(
            flag,
            dest=name,
            type=kind,
            default=getattr(defaults, name),
            metavar="N" if kind is int else "SECONDS",
            help=f"{what} (default {getattr(defaults, name):g})",
        )
    return parser


def parse_args(argv: Sequence[str]) -> DoctorOptions:
    """Parse and validate the command line.

    Raises:
        UserError: an unknown option or a bad value (one line, naming it).
        SystemExit: ``--help`` (status 0).
    """
    args = build_parser().parse_args(list(argv))
    try:
        return DoctorOptions(**vars(args))
    except ValueError as exc:
        name, _, message = str(exc).partition(": ")
        raise UserError(f"{_FLAGS.get(name, name)}: {message}") from None


def _int_or_none(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        return None


class Doctor:
    """Runs every check on this rank, in order, keeping the ranks in step for collectives."""

    def __init__(
        self, options: DoctorOptions, environ: Mapping[str, str], faults: frozenset[str]
    ) -> None:
        self.options = options
        self.environ = dict(environ)  # the user's environment, before we touch os.environ
        self.faults = faults
        self.results: list[CheckResult] = []
        self.current = "startup"
        self.rank = _int_or_none(environ, "RANK")
        self.world_size = _int_or_none(environ, "WORLD_SIZE") or 1
        self.env: distributed.DistEnv | None = None
        self.group_ready = False
        self.group_problem = "the process group was not created"
        self.print_claim = threading.Lock()
        """Held by whichever of the run and the deadline prints the report (the first to ask)."""
        self.lock = threading.Lock()
        self.facts: dict[str, object] = {}

    # -- helpers --

    @property
    def device(self) -> torch.device | None:
        return self.env.device if self.env else None

    def record(self, result: CheckResult) -> None:
        with self.lock:
            self.results.append(result)

    def say(self, name: str, status: str, detail: str) -> None:
        """Record a result that carries no measurements."""
        self.record(CheckResult(name=name, status=status, detail=detail))

    def check(self, name: str, fn: Callable[[], CheckResult], *, collective: bool) -> None:
        """Run one check; its crash is its FAIL. A collective check is skipped once the group is
        unusable, and its own failure makes it so (the rest could only hang)."""
        self.current = name
        if collective and not self.group_ready:
            self.say(name, SKIP, f"not run: {self.group_problem}")
            return
        try:
            self.record(fn())
        except Exception as exc:  # noqa: BLE001 - a check's crash is that check's FAIL
            log.debug("check %s failed", name, exc_info=True)
            if not collective:
                self.say(name, FAIL, f"the check crashed: {first_line(exc)}")
                return
            hint = ""
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                hint = f" (a peer did not take part within --timeout={self.options.timeout_s:g}s: hung, dead or slow)"
            self.say(name, FAIL, f"{first_line(exc)}{hint}")
            self.group_ready = False
            self.group_problem = f"the process group failed in the {name} check"

    # -- the run --

    def run(self) -> None:
        """Every check in order: the local ones, the process group, then the collective ones."""
        probe = checks.probe_backend()
        cuda_devices = torch.cuda.device_count() if probe.cuda else 0
        self.facts = {
            "env": {
                name: self.environ.get(name) for name in (*checks.TORCHRUN_ENV, "GROUP_WORLD_SIZE")
            },
            "timeouts_env": {name: self.environ.get(name) for name in checks.RUNTIME_TIMEOUT_ENV},
            "torch_version": torch.__version__,
            "nccl_version": probe.nccl_version,
            "backend": "nccl" if cuda_devices else "gloo",
            "faults": sorted(self.faults),
        }
        self.run_local(probe, cuda_devices)
        self.current = "process_group"
        self.init_group()
        rank = self.rank or 0
        setup = checks.Setup(
            rank=rank,
            world_size=self.world_size,
            device=self.device or torch.device("cpu"),
            batch_size=self.options.batch_size,
            iters=self.options.iters,
            warmup=self.options.warmup,
            sizes=self.options.sizes,
            faults=self.faults if rank == self.world_size - 1 else frozenset(),
        )
        if self.device is None:
            self.say("placement", SKIP, "not run: no device (see env/devices)")
        else:
            self.check("placement", lambda: _placement(setup), collective=False)
        for name, check in checks.COLLECTIVE_CHECKS.items():
            self.check(name, functools.partial(check, setup), collective=True)
        self.current = "gather"

    def run_local(self, probe: checks.BackendProbe, cuda_devices: int) -> None:
        """The checks that need no other rank: environment, backend, devices, timeouts."""
        local_checks: dict[str, Callable[[], CheckResult]] = {
            "env": lambda: checks.check_env(self.environ),
            "backend": lambda: checks.check_backend(probe),
            "devices": lambda: checks.check_devices(
                cuda_devices=cuda_devices,
                local_world_size=_int_or_none(self.environ, "LOCAL_WORLD_SIZE"),
                local_rank=_int_or_none(self.environ, "LOCAL_RANK"),
                cpu_count=checks.usable_cpus(),
                cuda_visible=self.environ.get("CUDA_VISIBLE_DEVICES"),
            ),
            "timeouts": lambda: checks.check_timeouts(
                self.environ, interfaces=checks.host_interfaces()
            ),
        }
        for name, check in local_checks.items():
            self.check(name, check, collective=False)

    def init_group(self) -> None:
        try:
            env = distributed.read_env(environ=self.environ)
        except ValueError as exc:
            self.group_problem = f"cannot join the process group: {exc}"
            self.say("process_group", SKIP, f"not run: {exc}")
            return
        self.env, self.rank, self.world_size = env, env.rank, env.world_size
        if env.device.type == "cuda":
            # The doctor wants collective errors raised where it can report them, not a process
            # torn down (1) or a hang (0): CleanUpOnly aborts the communicator and lets the
            # caller see the failure. Only this process's group; the timeouts check read the
            # user's own value before this line.
            os.environ[distributed.NCCL_ASYNC_ERROR_HANDLING] = "2"
        began = time.monotonic()
        try:
            distributed.init_process_group(env, pg_timeout_s=self.options.timeout_s)
            if env.launched:
                barrier(env.device)  # every rank is in: the group works, not only this end of it
        except Exception as exc:  # noqa: BLE001 - reported as this check's FAIL
            self.group_problem = "the process group could not be created"
            timeout = f"timeout {self.options.timeout_s:g} s"
            self.say("process_group", FAIL, f"{env.backend} with {timeout}: {first_line(exc)}")
            return
        self.group_ready = True
        how = (
            "torchrun's store"
            if env.launched
            else "one in-process store (not launched by torchrun)"
        )
        detail = (
            f"{env.backend}, {env.world_size} rank(s) via {how}, collective timeout {self.options.timeout_s:g} s, "
            f"ready in {time.monotonic() - began:.2f} s"
        )
        data = {"backend": env.backend}
        self.record(CheckResult(name="process_group", status=PASS, data=data, detail=detail))

    def rank_report(self, *, pending: str | None = None) -> RankReport:
        with self.lock:
            results = list(self.results)
        if pending:
            detail = f"did not finish within --deadline={self.options.deadline_s:g}s (the doctor was stopped)"
            results.append(CheckResult(name=pending, status=FAIL, detail=detail))
        return RankReport(
            rank=-1 if self.rank is None else self.rank,
            host=socket.gethostname(),
            device=str(self.device) if self.device else "?",
            facts=dict(self.facts),
            results=results,
        )


def _placement(setup: checks.Setup) -> CheckResult:
    """The placement check on the example model and a batch (left on ``meta`` by its fault)."""
    torch.manual_seed(0)
    module = setup.model.build().to(setup.device).train()
    batch_device = torch.device("meta") if "placement" in setup.faults else setup.device
    inputs, target = setup.model.batch(setup.batch_size, seed=setup.rank, device=setup.device)
    return checks.check_placement(
        module, inputs.to(batch_device), target.to(batch_device), setup.device
    )


def _gather(doctor: Doctor) -> tuple[list[RankReport], str | None]:
    """Every rank's report on every rank; only this rank's, with the reason, when impossible."""
    own = doctor.rank_report()
    if not doctor.group_ready:
        return [own], f"the other ranks' results could not be gathered ({doctor.group_problem})"
    gathered: list[object] = [None] * doctor.world_size
    try:
        dist.all_gather_object(gathered, own)
    except Exception as exc:  # noqa: BLE001 - fall back to this rank's own results
        return [own], f"the other ranks' results could not be gathered: {first_line(exc)}"
    return [r for r in gathered if isinstance(r, RankReport)], None


def _leave_together(doctor: Doctor) -> None:
    """A last barrier, so that no rank tears its connections down while a peer still reads from
    them (gloo aborts a process whose peer vanished mid-transfer). The report is out already:
    a failure here is only logged."""
    try:
        barrier(doctor.device or torch.device("cpu"))
    except Exception as exc:  # noqa: BLE001 - nothing left to report it in
        log.warning("final barrier failed: %s", first_line(exc))


def _emit(doctor: Doctor, report: MergedReport, *, as_json: bool) -> None:
    """Rank 0 prints the report; another rank that could not hand its results over names its
    failures on stderr (nobody else can). A rank that could not even tell where it belongs
    reports too (no rank 0 report can include it)."""
    if doctor.env is None or doctor.env.rank == 0:
        print(render_json(report) if as_json else render_text(report), flush=True)
    elif report.partial:
        for result in report.results:
            if result.status == FAIL:
                print(
                    f"doctor: rank {doctor.rank}: FAIL {result.name}: {result.detail}",
                    file=sys.stderr,
                    flush=True,
                )


def _options(
    argv: Sequence[str], environ: Mapping[str, str]
) -> tuple[DoctorOptions, frozenset[str]] | int:
    """The options and faults asked for, or the exit status for bad usage (2) or ``--help``."""
    quiet = _int_or_none(environ, "RANK") not in (None, 0)  # bad usage: say it once, on rank 0
    try:
        return parse_args(argv), checks.parse_faults(environ.get(checks.FAULT_ENV, ""))
    except ValueError as exc:  # UserError included
        if not quiet:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        elif "TORCHELASTIC_RUN_ID" in environ:
            # Under an elastic agent the first rank to exit non-zero gets the others killed: give
            # rank 0 (same arguments, same error) a bounded head start to print the one line.
            time.sleep(_QUIET_RANK_GRACE_S)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0


def _expire(doctor: Doctor) -> None:
    """The deadline timer's last word: the check that ran out of time, and what was found before
    it; then the process ends, whatever it is stuck in (a hung peer, a driver call, a collective
    whose timeout did not fire)."""
    try:
        if doctor.print_claim.acquire(blocking=False):
            _report_deadline(doctor)
    finally:
        os._exit(1)


def _report_deadline(doctor: Doctor) -> None:
    deadline_s = doctor.options.deadline_s
    print(
        f"{PROG}: rank {doctor.rank}: deadline of {deadline_s:g} s exceeded in the "
        f"{doctor.current} check; exiting",
        file=sys.stderr,
        flush=True,
    )
    report = merge(
        [doctor.rank_report(pending=doctor.current)],
        world_size=doctor.world_size,
        partial=f"stopped after --deadline={deadline_s:g}s in the {doctor.current} check",
    )
    _emit(doctor, report, as_json=doctor.options.json)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (every rank). Returns the exit status: 0 pass, 1 a check failed, 2 bad usage."""
    environ = dict(os.environ)
    parsed = _options(sys.argv[1:] if argv is None else argv, environ)
    if isinstance(parsed, int):
        return parsed
    options, faults = parsed
    logging.basicConfig(
        level=logging.DEBUG if options.verbose else logging.WARNING,
        stream=sys.stderr,
        format=f"%(asctime)s [rank {environ.get('RANK', '?')}] %(levelname)s %(name)s: %(message)s",
    )
    doctor = Doctor(options, environ, faults)
    watchdog = threading.Timer(options.deadline_s, _expire, args=(doctor,))
    watchdog.daemon = True
    watchdog.start()
    try:
        doctor.run()
        reports, partial = _gather(doctor)
        report = merge(reports, partial=partial, world_size=doctor.world_size)
        if doctor.print_claim.acquire(blocking=False):
            _emit(doctor, report, as_json=options.json)
        if not partial:
            _leave_together(doctor)
        return 0 if report.ok and not partial else 1
    finally:
        distributed.destroy_process_group()
        watchdog.cancel()


def run_main() -> None:
    """``python -m elastic_trainer.doctor``: run, then exit without interpreter teardown (gloo
    occasionally aborts there after a clean ``destroy_process_group``, which would turn a finished
    report into a failed rank). Everything is flushed first."""
    code = main()
    exit_process(code)
