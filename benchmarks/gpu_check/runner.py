"""Run the steps of a plan in order, each under its time limit, none past the budget; each step's
output goes into its log file and is read by the step's parser.

A step runs in a process group of its own (``start_new_session``), so that at its limit the
benchmark and every process it spawned (torch's spawned ranks, the launcher's workers) get
SIGTERM, then SIGKILL :data:`GRACE_S` later. Deadlines use ``time.monotonic()``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.gpu_check.parsers import Figures, OutputError
from benchmarks.gpu_check.plan import Plan, Step

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: every step runs there."""
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


def run_step(
    step: Step, *, out: Path, dry_run: bool, limit_s: float, env: Mapping[str, str]
) -> StepResult:
    """Run one step under ``limit_s`` and read its figures."""
    argv = [sys.executable, *step.argv(dry_run=dry_run, out=out)]
    for name in step.artifacts:
        (out / name).unlink(missing_ok=True)
    done = run_command(argv, limit_s=limit_s, log=out / f"{step.name}.log", cwd=ROOT, env=env)
    result = StepResult(step.name, "ok", returncode=done.returncode, duration_s=done.duration_s, limit_s=limit_s,
                        command=argv)  # fmt: skip
    if done.returncode is None:
        result.status, result.reason = "timed out", f"killed at its {limit_s:.0f} s limit"
    elif done.returncode not in step.ok_returncodes:
        last = ([line for line in done.output.splitlines() if line.strip()] or ["no output"])[-1]
        result.status, result.reason = "failed", f"exit {done.returncode}: {last.strip()[:200]}"
    else:
        try:
            result.figures = step.parse(done.output, out)
        except OutputError as exc:
            result.status, result.reason = "failed", str(exc)
    return result


def run_plan(plan: Plan, *, out: Path, dry_run: bool, gpus: int, only: Sequence[str],
             env: Mapping[str, str], budget_s: float | None = None) -> dict[str, StepResult]:  # fmt: skip
    """Run the selected steps in order, each under its limit, none past the budget; returns the
    result of each selected step by name (skipped ones included)."""
    budget = budget_s if budget_s is not None else plan.dry_budget_s if dry_run else plan.budget_s
    deadline = time.monotonic() + budget
    selected = [s for s in plan.steps if not only or s.name in only]
    results: dict[str, StepResult] = {}
    for index, step in enumerate(selected, start=1):
        label = f"[{index}/{len(selected)}] {step.name}"
        if not dry_run and gpus < step.min_gpus:
            reason = f"needs {step.min_gpus} GPUs, {gpus} visible" + (
                f" ({step.gpus_why})" if step.gpus_why else ""
            )
            results[step.name] = StepResult(step.name, "skipped", reason)
            print(f"{label}: skipped ({reason})", flush=True)
            continue
        remaining = deadline - time.monotonic() - 2 * GRACE_S
        if remaining < 1:
            reason = f"not started: the {budget:.0f} s budget is spent"
            results[step.name] = StepResult(step.name, "timed out", reason)
            print(f"{label}: {reason}", flush=True)
            continue
        limit = min(step.dry_limit_s if dry_run else step.limit_s, remaining)
        print(f"{label}: running (limit {limit:.0f} s, log {step.name}.log)", flush=True)
        result = results[step.name] = run_step(
            step, out=out, dry_run=dry_run, limit_s=limit, env=env
        )
        print(f"{label}: {result.status} in {result.duration_s:.1f} s{': ' + result.reason if result.reason else ''}",
              flush=True)  # fmt: skip
    return results
