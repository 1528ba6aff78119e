"""Just-in-time checkpoint: when the worker group fails, a surviving rank saves the last completed
step, so a worker SIGKILL costs at most one step instead of everything since the last periodic
checkpoint.

Invariants: a snapshot is taken holding the state's guard (``state.guard.StateGuard``) (never in the middle of an update);
any survivor writes exactly what rank 0 would have written (``state.buffers``); one
writer per step (claims; and no just-in-time save of a step this process's periodic write has
committed or still has in flight); every save is bounded (:data:`SAVE_TIMEOUT_S`, then the process
exits); a thread that may not read the live state while the training thread runs (sharded state
with no staged copy: ``may_save``) saves nothing, and the stall monitor then leaves the exit to
the graceful stop.
Triggers: a failing training loop (:meth:`JitCheckpointer.after_failure`) and a stop signal while
the training thread is stuck in a collective (:meth:`JitCheckpointer.on_signal`). Off with
``CheckpointConfig(jit_save=False)`` or ``ELASTIC_TRAINER_JIT_SAVE=0``. Design:
``docs/design/checkpointing.md``.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 -m elastic_trainer.examples.synthetic_cnn \
        --epochs 10 --checkpoint-dir /tmp/ckpt --checkpoint-every 1000 --throttle-ms 40 &
    sleep 8; kill -9 "$(pgrep -f synthetic_cnn | tail -1)"   # then: resumed from ... (a just-in-time checkpoint)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.runtime.exit_codes import EXIT_STOPPED
from elastic_trainer.runtime.failures import log_line
from elastic_trainer.state.guard import StateGuard

log = logging.getLogger(__name__)

TORCHRUN_STOP_WINDOW_S = 30.0
"""Seconds torchrun 2.13 waits between SIGTERM and SIGKILL (``PContext.close`` default timeout)."""
STALL_MIN_S = 1.0
"""After a stop signal, the shortest time without a step boundary that counts as a stall."""
STALL_MAX_S = 10.0
"""... and the longest (slow steps stretch it: :data:`STALL_STEPS` times the recent step time)."""
STALL_STEPS = 3.0
"""A stall lasts this many recent step durations (the graceful stop needs up to two steps)."""
SAVE_TIMEOUT_S = 15.0
"""Deadline of one JIT save (snapshot and write); past it the process exits."""
EXIT_MARGIN_S = 1.0
"""Kept free before torchrun's SIGKILL and the SIGTERM grace deadline."""
BACKSTOP_S = 0.5
"""The exit timer of a save fires this long after its deadline (every wait inside the save is
bounded by the deadline itself; the timer is for the calls that cannot be: a hung write)."""


@dataclass(frozen=True, slots=True)
class JitOutcome:
    """What a JIT save did."""

    saved: bool
    step: int | None
    path: str | None
    detail: str
    """Why it was skipped or failed, or what was written."""


# -- deadlines ---------------------------------------------------------------------------------------
class ExitTimer:
    """Ends the process with ``code`` unless cancelled within ``seconds`` (a save must never hang)."""

    def __init__(
        self, seconds: float, code: int, why: str, exit_fn: Callable[[int], Any] = os._exit
    ) -> None:
        self._cancelled = threading.Event()
        self._seconds, self._code, self._why, self._exit = seconds, code, why, exit_fn
        self._thread = threading.Thread(target=self._run, name="jit-deadline", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._cancelled.set()

    def _run(self) -> None:
        if self._cancelled.wait(max(0.0, self._seconds)):
            return
        log.error("%s did not finish within %.1f s; exiting now", self._why, self._seconds)
        flush_logs()
        self._exit(self._code)


def flush_logs() -> None:
    """Flush the root logger's handlers (before an exit that skips interpreter teardown)."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()


# -- the saver ---------------------------------------------------------------------------------------
class JitCheckpointer:
    """Saves the last completed step once, from whichever thread asks first.

    Args:
        guard: the trainer's :class:`StateGuard`.
        directory: the shared checkpoint directory.
        rank: recorded in the claim file.
        step: returns the number of completed steps (called holding the guard).
        payload: returns a host-memory copy of the state after that step (holding the guard).
        write: writes ``(step, payload)`` as a JIT checkpoint; returns its path.
        drain: waits up to the given seconds for this process's own checkpoint writes.
        stop_deadline: the graceful stop's deadline (``time.monotonic()``), if a signal set one.
        exit_fn: ends the process (tests inject a fake).
        writing: the step of this process's periodic checkpoint write still in flight, if any: a
            just-in-time save waits for it (bounded) and never writes that step a second time, and
            while it is in flight a missing step boundary is a stall only after
            :data:`STALL_MAX_S` (the background write slows the steps).
        may_save: why the calling thread must not save now (``None``: it may); e.g. sharded
            state with no staged copy, asked from a thread other than the training thread.
        enabled: ``False`` makes every method a no-op.
        exclusive: one writer per step (a claim): any rank writes the whole state. ``False``
            (sharded state): every rank writes its own part, and the writer commits the set.
    """

    def __init__(
        self,
        *,
        guard: StateGuard,
        directory: str | None,
        rank: int,
        step: Callable[[], int],
        payload: Callable[[], dict[str, Any]],
        write: Callable[[int, dict[str, Any]], str],
        drain: Callable[[float], None] = lambda timeout: None,
        stop_deadline: Callable[[], float | None] = lambda: None,
        exit_fn: Callable[[int], Any] = os._exit,
        writing: Callable[[], int | None] = lambda: None,
        may_save: Callable[[], str | None] = lambda: None,
        enabled: bool = True,
        exclusive: bool = True,
    ) -> None:
        self.guard = guard
        self.exclusive = exclusive
        self.directory = directory
        self.enabled = enabled and directory is not None
        self._rank = rank
        self._step, self._payload, self._write, self._drain = step, payload, write, drain
        self._stop_deadline = stop_deadline
        self._exit = exit_fn
        self._writing, self._may_save = writing, may_save
        self._save_lock = threading.Lock()
        self._outcome: JitOutcome | None = None
        self._armed = False
        self._stood_down = False
        self._busy = 0
        self._signal_at: float | None = None
        self._monitor: threading.Thread | None = None

    # -- trainer side (main thread) ---------------------------------------------------------------
    def arm(self) -> None:
        """Training started: the state now is a completed step (the one resumed from, or 0)."""
        self._armed = True
        self.guard.progress.set()

    def stand_down(self) -> None:
        """The ranks agreed to stop (or training ended): the graceful path owns the exit."""
        self._stood_down = True
        self.guard.progress.set()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """A checkpoint is being taken: not a stall, however long the write takes."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            self.guard.progress.set()

    def after_failure(self, exc: BaseException) -> JitOutcome | None:
        """Trigger (a): the training loop raised (a peer died). Saves within :data:`SAVE_TIMEOUT_S`.

        A failed checkpoint write is not retried here: the same disk would fail the same way.
        """
        if not self.enabled:
            return None
        if isinstance(exc, ckpt.CheckpointError):
            log.info("no just-in-time save after a checkpoint error (%s)", log_line(exc))
            return None
        if not self._armed:  # a mistake before the first step: nothing to save, nothing to say
            log.debug("no just-in-time save: training had not started (%s)", log_line(exc))
            return None
        log.warning(
            "training failed (%s); saving the last completed step just in time", log_line(exc)
        )
        return self.save(f"after {log_line(exc)}", deadline=time.monotonic() + SAVE_TIMEOUT_S)

    # -- signal side (wakeup thread) ------------------------------------------------------------------
    def on_signal(self, signum: int) -> None:
        """Trigger (b): a stop signal arrived (called at once, even while the main thread is
        blocked). Starts watching for step boundaries."""
        if not self.enabled or self._signal_at is not None:
            return
        self._signal_at = time.monotonic()
        self.guard.progress.clear()
        self._monitor = threading.Thread(
            target=self._watch, args=(signum,), name="jit-stall-monitor", daemon=True
        )
        self._monitor.start()

    def stall_timeout(self) -> float:
        return min(STALL_MAX_S, max(STALL_MIN_S, STALL_STEPS * self.guard.recent_step_s))

    def _watch(self, signum: int) -> None:
        name = signal.Signals(signum).name
        while not self._stood_down:
            timeout = self.stall_timeout()
            if self._writing() is not None:
                timeout = max(timeout, STALL_MAX_S)  # this process's own write slows the steps
            if self.guard.progress.wait(timeout):
                self.guard.progress.clear()
                continue
            if self._stood_down:
                return
            if self._busy or not self._armed:
                continue
            if (why := self._may_save()) is not None:
                log.warning(
                    "%s received and no step boundary for %.1f s, but no just-in-time save from "
                    "here: %s; the graceful stop (or the launcher) ends the run",
                    name,
                    timeout,
                    why,
                )
                return
            log.warning(
                "%s received and no step boundary for %.1f s (blocked in a collective?): saving the last "
                "completed step just in time, then exiting",
                name,
                timeout,
            )
            deadline = self._signal_deadline()
            self.save(f"{name}, main thread stalled {timeout:.1f} s", deadline=deadline)
            self._drain(max(0.0, deadline - time.monotonic()))
            flush_logs()
            self._exit(EXIT_STOPPED)
            return

    def _signal_deadline(self) -> float:
        now = time.monotonic()
        if self._signal_at is None:
            raise RuntimeError("signal deadline asked for before any signal arrived")
        deadline = min(
            now + SAVE_TIMEOUT_S, self._signal_at + TORCHRUN_STOP_WINDOW_S - EXIT_MARGIN_S
        )
        stop = self._stop_deadline()
        if stop is not None:
            deadline = min(deadline, stop - EXIT_MARGIN_S)
        return max(deadline, now + 0.5)

    # -- the save -----------------------------------------------------------------------------------
    def save(self, reason: str, *, deadline: float) -> JitOutcome:
        """Save the last completed step unless done already; idempotent and thread-safe.

        Ends the process (exit code 1) if the save is still running at ``deadline``.
        """
        if not self.enabled:
            return JitOutcome(
                saved=False, step=None, path=None, detail="just-in-time saving is off"
            )
        if (why := self._may_save()) is not None:
            # Not remembered as the outcome: the training thread may still save.
            log.warning("no just-in-time save from this thread: %s", why)
            return JitOutcome(saved=False, step=None, path=None, detail=why)
        timer = ExitTimer(
            deadline + BACKSTOP_S - time.monotonic(), 1, "the just-in-time checkpoint", self._exit
        )
        try:
            acquired = self._save_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            if not acquired:
                return JitOutcome(
                    saved=False, step=None, path=None, detail="another save is still running"
                )
            try:
                if self._outcome is None:
                    self._outcome = self._save(reason, deadline)
                return self._outcome
            finally:
                self._save_lock.release()
        finally:
            timer.cancel()

    def _save(self, reason: str, deadline: float) -> JitOutcome:
        started = time.monotonic()
        if self.directory is None:
            raise RuntimeError("just-in-time save requested without a checkpoint directory")
        claim: ckpt.StepClaim | None = None
        step: int | None = None
        if self._writing() is not None:
            # This process's periodic write may commit the very step: let it end first (bounded).
            self._drain(max(0.0, (deadline - time.monotonic()) / 2))
        try:
            with self.guard.hold(timeout=deadline - started):
                if not self._armed:
                    return self._skip(None, "training had not started")
                if not self.guard.consistent:
                    return self._skip(
                        None,
                        "the failure happened inside an optimizer update; the state is inconsistent",
                    )
                step = self._step()
                if (why := _exists(self.directory, step)) is not None:
                    return self._skip(step, why)
                if (writing := self._writing()) is not None and writing >= step:
                    return self._skip(
                        step, f"this process's periodic checkpoint of step {writing} is in flight"
                    )
                if self.exclusive:
                    claim = ckpt.try_claim(self.directory, step, rank=self._rank, kind="jit")
                    if claim is None:
                        return self._skip(step, self._claimed(self.directory, step, deadline))
                # Re-check with the claim held: a writer may have finished this step and
                # released its claim between the check above and ours.
                if (why := _exists(self.directory, step)) is not None:
                    return self._skip(step, why)
                payload = self._payload()
            path = self._write(step, payload)
        except Exception as exc:  # noqa: BLE001 - reported; the process is going down anyway
            log.error("just-in-time save of step %s failed: %s", step, log_line(exc))
            return JitOutcome(saved=False, step=step, path=None, detail=f"failed: {log_line(exc)}")
        finally:
            if claim is not None:
                claim.release()
        took = time.monotonic() - started
        log.warning(
            "just-in-time checkpoint of step %d written to %s in %.2f s (%s)",
            step,
            path,
            took,
            reason,
        )
        return JitOutcome(
            saved=True, step=step, path=path, detail=f"written in {took:.2f} s ({reason})"
        )

    def _claimed(self, directory: str, step: int, deadline: float) -> str:
        """Another writer claimed ``step``: what it is (a write of this process's own is let
        finish first, bounded)."""
        holder = ckpt.read_claim(directory, step)
        if ckpt.held_by_this_process(holder):
            self._drain(max(0.0, deadline - time.monotonic()))
        return f"step {step} is being written by {holder or 'another writer'}"

    @staticmethod
    def _skip(step: int | None, why: str) -> JitOutcome:
        log.info("just-in-time save skipped: %s", why)
        return JitOutcome(saved=False, step=step, path=None, detail=why)


def _exists(directory: str, step: int) -> str | None:
    """Why ``step`` needs no saving: a checkpoint of it or a later step exists (``None``: none)."""
    newest = ckpt.newest_step(directory)
    return (
        f"a checkpoint of step {newest} exists" if newest is not None and newest >= step else None
    )
