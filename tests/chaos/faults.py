"""Fault injection for the chaos suite: nodes as launcher processes, and faults fired at steps.

A *node* is one ``elastic-trainer run`` launcher process (torchrun's agent runs inside it) with
its own workers, started by :func:`start_node`; it is an
:class:`elastic_trainer.ops.processes.NodeProcess`, so its ``kill_worker``, ``kill_node`` and
``terminate`` are the process faults. :class:`FaultInjector` fires faults when the job reaches given steps, read from the
runtime's own sample records, as torchft's ``EventInjector().fail_at(rank, step)`` does::

    faults = FaultInjector(run).at_step(20, "worker SIGKILL", lambda: node_b.kill_worker())
    faults.run_until(lambda: node_a.proc.poll() is not None, timeout=150, agents=[node_a, node_b])

The other faults here act on files: :class:`SmallDisk` (a tmpfs that can be filled) and
:func:`corrupt_newest_checkpoint`. Network partitions are in :mod:`tests.chaos.netns`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.ops.processes import start_process
from elastic_trainer.runtime.sample_log import read_records
from tests.support.agents import Agent, tails
from tests.support.ci import IN_CI
from tests.support.records import steps_recorded

REPO = Path(__file__).resolve().parents[2]
CHAOS_JOB = Path(__file__).with_name("chaos_job.py")

# Fast rounds and a short liveness bound: the 30 s defaults would dominate every scenario.
FAST_RDZV_CONF = "lease_ttl=4,retry_timeout=20"
FAST_LAUNCH_OPTIONS = (
    "--join-timeout",
    "120",
    "--last-call-timeout",
    "1",
    "--monitor-interval",
    "0.2",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """The training job of a scenario: the example's arguments, minus the run's directories."""

    dataset_size: int = 384
    global_batch_size: int = 12
    epochs: int = 3
    seed: int = 5
    lr: float = 0.2
    """With these settings the full-dataset loss falls from 2.30 to about 1.95 in the 96 steps."""
    checkpoint_every: int = 5
    throttle_ms: float = 40.0
    keep_last: int = 1000
    """Large: every checkpoint stays, so the suite can prove that none was lost or skipped."""

    def __post_init__(self) -> None:
        for name in (
            "dataset_size",
            "global_batch_size",
            "epochs",
            "checkpoint_every",
            "keep_last",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.dataset_size // self.global_batch_size)

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def math_args(self) -> list[str]:
        """The arguments that decide the weights (the same for a scenario and its reference)."""
        # --max-steps is the end of the run anyway; it also makes the cosine schedule reach 0 there,
        # so the final weights settle instead of ending on a noisy step.
        return [
            "--dataset-size",
            str(self.dataset_size),
            "--global-batch-size",
            str(self.global_batch_size),
            "--epochs",
            str(self.epochs),
            "--max-steps",
            str(self.steps),
            "--seed",
            str(self.seed),
            "--lr",
            str(self.lr),
        ]

    def args(self, run: RunDirs) -> list[str]:
        return [
            *self.math_args(),
            "--checkpoint-dir",
            str(run.checkpoints),
            "--checkpoint-every",
            str(self.checkpoint_every),
            "--keep-last",
            str(self.keep_last),
            "--record-samples",
            str(run.samples),
            "--throttle-ms",
            str(self.throttle_ms),
            "--log-every",
            "4",
        ]


@dataclass(frozen=True, slots=True)
class RunDirs:
    """Where one run keeps its checkpoints, sample records and node logs."""

    root: Path
    checkpoints: Path

    @classmethod
    def under(cls, root: Path, checkpoints: Path | None = None) -> RunDirs:
        root.mkdir(parents=True, exist_ok=True)
        return cls(root, checkpoints or root / "ckpt")

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    def log(self, node: str) -> Path:
        return self.root / f"node-{node}.log"

    def steps(self, *, world_size: int | None = None) -> int:
        """The highest step any rank has recorded so far."""
        return steps_recorded(self.samples, world_size=world_size)

    def steps_trained(self) -> int:
        """Steps rank 0 has completed so far, redone ones included (grows even after a rollback)."""
        if not self.samples.exists():
            return 0
        return sum(
            1
            for records in read_records(self.samples)
            for r in records
            if r["event"] == "done" and records[0]["rank"] == 0
        )


def start_node(
    *,
    name: str,
    run: RunDirs,
    job: JobSpec,
    endpoint: str,
    run_id: str,
    nnodes: str,
    nproc_per_node: int = 1,
    max_restarts: int = 10,
    metrics_port: int = 0,
    env: dict[str, str] | None = None,
    netns: str | None = None,
    local_addr: str | None = None,
    rdzv_conf: str = FAST_RDZV_CONF,
    worker: Sequence[str] | None = None,
    launch_options: Sequence[str] = (),
) -> Agent:
    """Start one node: ``elastic-trainer run ... tests/chaos/chaos_job.py JOB_ARGS``.

    Args:
        worker: the worker and its arguments instead (``job`` then only names the run).
        launch_options: more ``elastic-trainer run`` options (``--heal off``).
        netns: run the node inside this network namespace (``ip netns exec``).
        local_addr: the address other nodes reach this one at (torchrun's ``--local-addr``,
            passed as ``PET_LOCAL_ADDR``); needed when the hostname does not resolve to it.
    """
    node_env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        ELASTIC_TRAINER_SIGTERM_GRACE_S="20",
        **(env or {}),
    )
    node_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if local_addr is not None:
        node_env["PET_LOCAL_ADDR"] = local_addr
    cmd = [
        sys.executable,
        "-m",
        "elastic_trainer.cli",
        "run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc_per_node),
        "--device",
        "cpu",
        "--rdzv-endpoint",
        endpoint,
        "--run-id",
        run_id,
        "--rdzv-conf",
        rdzv_conf,
        "--max-restarts",
        str(max_restarts),
        "--metrics-port",
        str(metrics_port),
        *FAST_LAUNCH_OPTIONS,
        *launch_options,
        *(worker if worker is not None else (str(CHAOS_JOB), *job.args(run))),
    ]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    # `ip netns exec` execs the command in place: the pid is the launcher's either way.
    return start_process(cmd, run.log(name), node_env, cwd=REPO)


def start_nodes(started: list[Agent], names: Sequence[str], **options: Any) -> None:
    """Start one node per name, all with the same :func:`start_node` options, each added to
    ``started`` (the list :func:`agents` stops) as soon as it runs."""
    for name in names:
        started.append(start_node(name=name, **options))


def unique_run_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# -- faults at steps -----------------------------------------------------------------------------
@dataclass(slots=True)
class Fault:
    """One fault: fire ``action`` once ``trigger(step)`` holds (``step``: the job's current step)."""

    name: str
    trigger: Callable[[int], bool]
    action: Callable[[], object]
    fired_at: float | None = None
    """``time.time()`` when it fired (unix time, comparable with the records' timestamps)."""
    fired_at_step: int | None = None
    fired_at_trained: int | None = None
    """:meth:`RunDirs.steps_trained` when it fired."""


@dataclass(slots=True)
class FaultInjector:
    """Fires faults in the order they were added, each once its trigger holds (see the module
    docstring). Actions run on the caller's thread: one that blocks (an etcd outage) should
    start a thread.

    Args:
        run: the run whose sample records tell the current step.
    """

    run: RunDirs
    faults: list[Fault] = field(default_factory=list)
    poll_s: float = 0.05

    def at_step(self, step: int, name: str, action: Callable[[], object]) -> FaultInjector:
        """Fire ``action`` once any rank has recorded ``step`` (and the faults before it fired)."""
        return self.when(lambda current: current >= step, name, action)

    def when(
        self, trigger: Callable[[int], bool], name: str, action: Callable[[], object]
    ) -> FaultInjector:
        self.faults.append(Fault(name, trigger, action))
        return self

    def pending(self) -> list[Fault]:
        return [f for f in self.faults if f.fired_at is None]

    def run_until(
        self, done: Callable[[], bool], *, timeout: float, agents: Sequence[Agent] = ()
    ) -> list[Fault]:
        """Fire the faults as their triggers come, until ``done()``; fail after ``timeout`` seconds.

        Raises:
            AssertionError: the deadline passed, or the job ended with faults not fired.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            step = self.run.steps()
            for fault in self.pending():
                if not fault.trigger(step):
                    break
                fault.fired_at, fault.fired_at_step = time.time(), step
                fault.fired_at_trained = self.run.steps_trained()
                fault.action()
            if done():
                unfired = [f.name for f in self.pending()]
                if unfired:
                    raise AssertionError(
                        f"the job ended before these faults fired: {unfired}\n{tails(agents)}"
                    )
                return self.faults
            time.sleep(self.poll_s)
        raise AssertionError(
            f"not done after {timeout:.0f} s (step {self.run.steps()}; fired "
            f"{[(f.name, f.fired_at_step) for f in self.faults if f.fired_at]})\n{tails(agents)}"
        )


def in_background(
    action: Callable[[], object], threads: list[threading.Thread]
) -> Callable[[], None]:
    """An action that runs ``action`` on a new thread (appended to ``threads`` for joining)."""

    def start() -> None:
        thread = threading.Thread(target=action, name="chaos-fault", daemon=True)
        thread.start()
        threads.append(thread)

    return start


def wait_all(agents: Sequence[Agent], timeout: float) -> dict[str, int | None]:
    """Wait for every agent to exit (sharing one deadline); their exit codes by log name."""
    deadline = time.monotonic() + timeout
    codes: dict[str, int | None] = {}
    for agent in agents:
        try:
            codes[agent.log_path.name] = agent.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[agent.log_path.name] = None
    return codes


def freeze_workers(agents: Sequence[Agent]) -> list[int]:
    """SIGSTOP every worker of ``agents`` (the job stands still while files are tampered with)."""
    stopped = []
    for agent in agents:
        for pid in agent.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
    return stopped


def thaw(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def kill(pids: Sequence[int]) -> None:
    """SIGKILL these processes (frozen ones too)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# -- file faults ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DamageWindow:
    """A checkpoint a scenario damaged on purpose, and when it was valid."""

    step: int
    created_unix: float
    """From its manifest."""
    damaged_unix: float


def damage_newest_checkpoint(directory: Path) -> DamageWindow:
    """:func:`corrupt_newest_checkpoint`, and when the damaged checkpoint had been valid."""
    steps = list(ckpt.iter_checkpoints(directory))
    created = (
        ckpt.Manifest.from_json(ckpt.manifest_path(directory, steps[-1]).read_text()).created_unix
        if steps
        else 0.0
    )
    step = corrupt_newest_checkpoint(directory)
    return DamageWindow(step=step, created_unix=created, damaged_unix=time.time())


def corrupt_newest_checkpoint(directory: Path) -> int:
    """Flip bytes in the middle of the newest checkpoint's ``.pt`` (its manifest stays, so the
    sha256 no longer matches); returns its step."""
    steps = list(ckpt.iter_checkpoints(directory))
    if not steps:
        raise AssertionError(f"no checkpoint to corrupt in {directory}")
    path = ckpt.checkpoint_path(directory, steps[-1])
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))
    return steps[-1]


class SmallDisk:
    """A small tmpfs mounted for one test (needs root); :meth:`fill` leaves it almost full.

    Always unmounted by :meth:`close` (use it as a context manager).
    """

    def __init__(self, mountpoint: Path, size_bytes: int) -> None:
        self.mountpoint = mountpoint
        self.size_bytes = size_bytes
        self._ballast = mountpoint / ".ballast"
        self._mounted = False

    def __enter__(self) -> SmallDisk:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={self.size_bytes},mode=0755",
                "tmpfs",
                str(self.mountpoint),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise PermissionError(
                f"cannot mount a tmpfs at {self.mountpoint} (needs root): {done.stderr.strip()}"
            )
        self._mounted = True
        return self

    def free_bytes(self) -> int:
        stat = os.statvfs(self.mountpoint)
        return stat.f_bavail * stat.f_frsize

    def fill(self, leave_bytes: int) -> None:
        """Write a ballast file until fewer than ``leave_bytes`` bytes are free."""
        block = b"\0" * (64 << 10)
        with open(self._ballast, "ab") as ballast:
            while self.free_bytes() > leave_bytes:
                chunk = min(len(block), self.free_bytes() - leave_bytes)
                try:
                    ballast.write(block[: max(chunk, 4096)])
                    ballast.flush()
                except OSError:
                    break

    def free(self) -> None:
        """Delete the ballast (an operator made room)."""
        with contextlib.suppress(FileNotFoundError):
            self._ballast.unlink()

    def close(self) -> None:
        if self._mounted:
            subprocess.run(
                ["umount", "-l", str(self.mountpoint)], capture_output=True, timeout=30, check=False
            )
            self._mounted = False

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def small_disk(mountpoint: Path, size_bytes: int) -> Iterator[SmallDisk]:
    """A :class:`SmallDisk`, failing (in CI) or skipping (elsewhere) where tmpfs cannot be mounted."""
    import pytest

    disk = SmallDisk(mountpoint, size_bytes)
    try:
        disk.__enter__()
    except PermissionError as exc:
        if IN_CI:
            pytest.fail(f"the disk-full scenario needs to mount a tmpfs (run CI as root): {exc}")
        pytest.skip(str(exc))
    try:
        yield disk
    finally:
        disk.close()
