"""Run one step under its time limit, its output into a log file.

A step runs in a process group of its own (``start_new_session``), so that at its limit the
benchmark and every process it spawned (torch's spawned ranks, the launcher's workers) get
SIGTERM, then SIGKILL :data:`GRACE_S` later. Deadlines use ``time.monotonic()``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.gpu_check.parsers import Figures

GRACE_S = 5.0  # between SIGTERM and SIGKILL at a step's limit


@dataclass(slots=True)
class StepResult:
    """What became of one step."""

    name: str
    status: str
    """``ok``, ``failed`` (exit code, or unreadable output), ``timed out`` or ``skipped``."""
    reason: str = ""
    """One line: why it failed or was skipped."""
    returncode: int | None = None
    duration_s: float = 0.0
    limit_s: float = 0.0
    command: list[str] = field(default_factory=list)
    figures: Figures = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Completed:
    """A finished command: its exit code (``None``: killed at the limit), time and output."""

    returncode: int | None
    duration_s: float
    output: str


def run_command(argv: Sequence[str], *, limit_s: float, log: Path, cwd: Path,
                env: Mapping[str, str]) -> Completed:  # fmt: skip
    """Run ``argv`` with stdout and stderr into ``log``; kill its process group at ``limit_s``."""
    started = time.monotonic()
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(argv)}\n")
        sink.flush()
        process = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        returncode: int | None
        try:
            returncode = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _stop_group(process)
            returncode = None
        finally:
            if process.poll() is None:  # interrupted (Ctrl-C): leave nothing behind
                _stop_group(process)
    duration = time.monotonic() - started
    return Completed(returncode, duration, log.read_text(errors="replace"))


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, SIGKILL it after :data:`GRACE_S`; reap the leader."""
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; its group may still hold spawned children.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        return
