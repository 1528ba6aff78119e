"""The checkpoint manager's just-in-time save: when the worker group fails, a surviving rank saves
the last completed step, so a worker SIGKILL costs at most one step instead of everything since
the last periodic checkpoint.

    jit = manager.just_in_time
    jit.arm(stop_deadline=lambda: stop.deadline)   # training starts: the state is a completed step
    jit.on_signal(signum)                          # a stop signal (from the wakeup thread)
    jit.stand_down()                               # the ranks agreed to stop: the graceful path exits
    jit.after_failure(exc)                         # the loop raised: save (bounded), then end soon
    jit.save(reason, deadline=...)                 # any thread: save now (idempotent)

What is written depends on the state: a whole replicated state as one file (any survivor, one
writer per step through claims); a sharded state's own shards, no collective, the rank completing
the set commits it; or, with the neighbour copy, every shard this rank holds, a lost rank's too
(``checkpoint/sharded_jit.py``). The files are the manager's.

Invariants: a snapshot is taken holding the state's guard (``state.guard.StateGuard``) (never in
the middle of an update); any survivor writes exactly what rank 0 would have written
(``state.buffers``); one writer per step (claims; and no just-in-time save of a step this
process's periodic write has committed or still has in flight); every save is bounded
(:data:`SAVE_TIMEOUT_S`, then the process exits); a thread that may not read the live state while
the training thread runs (sharded state with no staged copy) saves nothing, and the stall monitor
then leaves the exit to the graceful stop.
Triggers: a failing training loop (:meth:`JustInTime.after_failure`) and a stop signal while the
training thread is stuck in a collective (:meth:`JustInTime.on_signal`). Off with
``CheckpointConfig(jit_save=False)`` or ``ELASTIC_TRAINER_JIT_SAVE=0``. Design:
``docs/design/checkpointing.md``, ``docs/design/sharded.md``.

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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint import sharded, sharded_jit
from elastic_trainer.runtime import rng
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.exit_codes import EXIT_STOPPED
from elastic_trainer.runtime.failures import log_line
from elastic_trainer.state.training_state import TrainingState

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
TEARDOWN_S = 10.0
"""After a failure, the just-in-time save plus the teardown must end within ``SAVE_TIMEOUT_S +
TEARDOWN_S``; past that the process exits (code 1) instead of hanging."""
EXIT_MARGIN_S = 1.0
"""Kept free before torchrun's SIGKILL and the SIGTERM grace deadline."""
BACKSTOP_S = 0.5
"""The exit timer of a save fires this long after its deadline (every wait inside the save is
bounded by the deadline itself; the timer is for the calls that cannot be: a hung write)."""

Payload = Callable[[Mapping[str, Any]], dict[str, Any]]
"""The manager's: what a checkpoint holds around ``state`` (format, fingerprint, config)."""
WriteFile = Callable[[dict[str, Any], int, int], str]
"""The manager's: write ``(payload, step, epoch)`` as a just-in-time single-file checkpoint."""


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
class JustInTime:
    """The just-in-time save of one :class:`~.manager.CheckpointManager`: saves the last completed
    step once, from whichever thread asks first (see the module docstring). Off until
    :meth:`setup` (the load) turns it on.

    Args:
        state: what is saved (its guard, step, snapshot and, sharded, its neighbour copy).
        env: this worker's place in the job (the rank is recorded in the claim file).
        directory: the shared checkpoint directory (``None``: never saves).
        switch: whether the job wants the save (config, else ``ELASTIC_TRAINER_JIT_SAVE``).
        sharded: the sharded state's checkpointer (``None``: a replicated state, one file, one
            writer per step through a claim; else every rank writes its own part, and the writer
            completing the set commits it).
        writer: this process's background checkpoint writer (waited for before a save).
        payload: :data:`Payload`.
        write_file: :data:`WriteFile`.
        writing: the step of this process's periodic checkpoint write still in flight, if any: a
            just-in-time save waits for it (bounded) and never writes that step a second time, and
            while it is in flight a missing step boundary is a stall only after
            :data:`STALL_MAX_S` (the background write slows the steps).
        exit_fn: ends the process (tests inject a fake).
    """

    def __init__(
        self,
        *,
        state: TrainingState,
        env: DistEnv,
        directory: str | None,
        switch: bool,
        sharded: sharded.ShardedCheckpointer | None,
        writer: ckpt.AsyncCheckpointWriter,
        payload: Payload,
        write_file: WriteFile,
        writing: Callable[[], int | None],
        exit_fn: Callable[[int], Any] = os._exit,
    ) -> None:
        self.guard = state.guard
        self.directory = directory
        self.enabled = False
        self._state, self._env, self._switch = state, env, switch
        self._sharded, self._writer = sharded, writer
        self._payload_of, self._write_file, self._writing = payload, write_file, writing
        self._exit = exit_fn
        self._stop: Callable[[], float | None] = lambda: None
        self._deadline: ExitTimer | None = None
        self._shard_saver: sharded_jit.ShardedJit | None = None
        self._training_thread: int | None = None
        self._save_lock = threading.Lock()
        self._outcome: JitOutcome | None = None
        self._armed = False
        self._stood_down = False
        self._busy = 0
        self._signal_at: float | None = None
        self._monitor: threading.Thread | None = None

    # -- set up by the manager's load ------------------------------------------------------------
    def wanted(self) -> bool:
        """This rank's view of whether to save just in time (rank 0's is the one used)."""
        if not self._switch:
            if self._env.is_rank0:
                log.info(
                    "just-in-time checkpoints are off (jit_save=False or ELASTIC_TRAINER_JIT_SAVE=0)"
                )
            return False
        if self.directory is None:
            return False
        if any(hasattr(obj, "consolidate_state_dict") for obj in self._state.objects.values()):
            if self._env.is_rank0:
                log.warning(
                    "just-in-time checkpoints are off with a sharded optimizer (ZeroRedundancyOptimizer): its "
                    "state is spread over the ranks and its step runs collectives, so no single surviving rank "
                    "holds it; a failure resumes from the last periodic checkpoint"
                )
            return False
        return True

    def setup(self, enabled: bool) -> None:
        """(The training thread, after a load or restore) whether this attempt saves just in time
        (rank 0's decision), and from what."""
        self._training_thread = threading.get_ident()
        self._shard_saver = None
        if enabled and self._sharded is not None:
            self._shard_saver = self._held_shards_saver(self._sharded)
        self.enabled = enabled and self.directory is not None
        self._state.track_buffers(enabled)

    def _held_shards_saver(
        self, checkpointer: sharded.ShardedCheckpointer
    ) -> sharded_jit.ShardedJit | None:
        """The saver of every shard this rank holds, with the neighbour copy (``ring``); else
        ``None`` (this rank's own shards only, said once)."""
        copies, shards = self._state.copies, self._state.sharded
        if shards is not None and copies is not None and copies.mode == "ring":
            shards.checkpoint_names()  # on this thread: a save may run on another
            return sharded_jit.ShardedJit(checkpointer, shards, copies, extras=self._part_entries)
        off = copies is None or copies.mode == "off"
        if off and self._env.world_size > 1 and self._env.is_rank0:
            log.info(
                "just-in-time checkpoints of sharded state hold a rank's shards only while it "
                "lives: the neighbour copy is off (shard_copy every=0, "
                "ELASTIC_TRAINER_SHARD_COPY_EVERY=0) or not kept for this mesh (HSDP), so "
                "after a worker's death the job resumes from the newest periodic checkpoint"
            )
        return None

    # -- the trainer side (the training thread) ----------------------------------------------------
    def arm(self, stop_deadline: Callable[[], float | None] = lambda: None) -> None:
        """Training starts: the state now is a completed step (the one resumed from, or 0; every
        rank holds the same buffers). ``stop_deadline``: the graceful stop's deadline
        (``time.monotonic()``), if one is running (the loop owns the stop signal)."""
        self._stop = stop_deadline
        self._state.arm()
        self._armed = True
        self.guard.progress.set()

    def stop_deadline(self) -> float | None:
        """The graceful stop's deadline, if one is running (what :meth:`arm` was given)."""
        return self._stop()

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
        """Trigger (a): the training loop raised (a peer died). Saves within :data:`SAVE_TIMEOUT_S`,
        and makes sure the process ends soon after (:data:`TEARDOWN_S`).

        A failed checkpoint write is not retried here: the same disk would fail the same way.
        """
        if not self.enabled:
            return None
        # Save, then let the exception end the process quickly: torchrun restarts the group
        # once all its local workers are gone. Never hang on the way.
        self._deadline = ExitTimer(
            SAVE_TIMEOUT_S + TEARDOWN_S, 1, "saving and stopping after a failure", self._exit
        )
        if isinstance(exc, ckpt.CheckpointError):
            log.info("no just-in-time save after a checkpoint error (%s)", log_line(exc))
            return None
        if not self._armed:  # a mistake before the first step: nothing to save, nothing to say
            log.debug("no just-in-time save: training had not started (%s)", log_line(exc))
            return None
        log.warning(  # the failure itself is said once, where it is reported (failures.py)
            "training failed (%s); saving the last completed step just in time", type(exc).__name__
        )
        return self.save(f"after {log_line(exc)}", deadline=time.monotonic() + SAVE_TIMEOUT_S)

    def close(self) -> None:
        """Stand down, and cancel the after-failure deadline (the caller's teardown is done)."""
        self.stand_down()
        if self._deadline is not None:
            self._deadline.cancel()

    # -- the signal side (the wakeup thread) -------------------------------------------------------
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
        stop = self.stop_deadline()
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
                step = self._state.step
                if (why := _exists(self.directory, step)) is not None:
                    return self._skip(step, why)
                if (writing := self._writing()) is not None and writing >= step:
                    return self._skip(
                        step, f"this process's periodic checkpoint of step {writing} is in flight"
                    )
                if self._sharded is None:  # one writer per step: any rank writes the whole state
                    claim = ckpt.try_claim(self.directory, step, rank=self._env.rank, kind="jit")
                    if claim is None:
                        return self._skip(step, self._claimed(self.directory, step, deadline))
                # Re-check with the claim held: a writer may have finished this step and
                # released its claim between the check above and ours.
                if (why := _exists(self.directory, step)) is not None:
                    return self._skip(step, why)
                payload = self._snapshot()
            path = self._write_step(step, payload)
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

    # -- what is written ------------------------------------------------------------------------------
    def _may_save(self) -> str | None:
        """Why the calling thread must not save just in time (``None``: it may). Sharded state is
        read live only on the training thread: FSDP2 swaps a module's parameters between sharded
        and unsharded ones (and frees the unsharded storage) around forward and backward, so a
        state dict read on another thread while that thread runs breaks both. Another thread
        saves the neighbour copy's staged shards instead, or nothing."""
        if (
            self._sharded is None
            or self._shard_saver is not None
            or threading.get_ident() == self._training_thread
        ):
            return None
        return (
            "this rank's sharded (FSDP2) state is live on the training thread, which may still "
            "be running, and there is no staged copy of it (the neighbour copy is off)"
        )

    def _snapshot(self) -> dict[str, Any]:
        """(Holding the guard) a host copy of the state after the last completed step (none with
        the neighbour copy: the shards are written from the copies it staged)."""
        if self._shard_saver is not None:
            return {}
        return self._payload_of(self._state.snapshot())

    def _write_step(self, step: int, payload: dict[str, Any]) -> str:
        """Write the snapshot of ``step``; returns where it went (or, for a sharded state whose
        set is not complete yet, what this rank wrote)."""
        if self.directory is None:
            raise RuntimeError("just-in-time checkpointing needs a directory")
        if self._shard_saver is not None:
            live = threading.get_ident() == self._training_thread
            return self._shard_saver.write(step, live=live)
        if self._sharded is None:
            return self._write_file(payload, step, int(payload["epoch"]))
        # Each rank's own shards, no collective; the rank completing the set commits it.
        committed = self._sharded.save_own(payload, step=step, epoch=int(payload["epoch"]))
        if committed is not None:
            return str(committed.path)
        return (
            f"{sharded.jit_path(self.directory, step, self._sharded.token)} (this rank's "
            "shards; the checkpoint counts once every rank's are in)"
        )

    def _part_entries(self, step: int, part: Mapping[str, Any]) -> dict[str, Any]:
        """What a checkpoint of ``step`` holds besides a part's shards and objects (as the
        manager's payload of a snapshot adds them)."""
        return self._payload_of(
            {
                "rng": {"scheme": rng.STEP_SCHEME, "seed": self._state.seed},
                "step": step,
                "epoch": sharded_jit.part_epoch(part, self._state.epoch),
                "world_size": self._env.world_size,
                "jit": {"writer_rank": self._env.rank, "buffers": "own"},
            }
        )

    def _drain(self, timeout: float) -> None:
        """Let this process's own background checkpoint write finish before it exits. A failed
        write is said in one line and not raised: the just-in-time save that drains it reads what
        reached the disk afterwards and writes the step itself when the write did not commit it."""
        try:
            self._writer.wait(timeout)
        except ckpt.CheckpointError as exc:
            log.warning("the background checkpoint write failed: %s", exc)


def _exists(directory: str, step: int) -> str | None:
    """Why ``step`` needs no saving: a checkpoint of it or a later step exists (``None``: none)."""
    newest = ckpt.newest_step(directory)
    return (
        f"a checkpoint of step {newest} exists" if newest is not None and newest >= step else None
    )
