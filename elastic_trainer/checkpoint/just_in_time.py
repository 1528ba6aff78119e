"""The checkpoint manager's just-in-time save: which saver writes the last completed step when the
group fails, and the triggers a training loop hands it.

    jit = manager.just_in_time
    jit.arm(stop_deadline=lambda: stop.deadline)   # training starts: the state is a completed step
    jit.on_signal(signum)                          # a stop signal (from the wakeup thread)
    jit.stand_down()                               # the ranks agreed to stop: the graceful path exits
    jit.after_failure(exc)                         # the loop raised: save (bounded), then end soon
    jit.save(reason, deadline=...)                 # any thread: save now (idempotent)

What is written depends on the state: a whole replicated state as one file (any survivor, one
writer per step through claims); a sharded state's own shards, no collective, the rank completing
the set commits it; or, with the neighbour copy, every shard this rank holds, a lost rank's too
(``checkpoint/sharded_jit.py``). The triggers and the bounds are :mod:`.jit`'s; the files are the
manager's. Design: ``docs/design/checkpointing.md``, ``docs/design/sharded.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint import sharded, sharded_jit
from elastic_trainer.checkpoint.jit import SAVE_TIMEOUT_S, ExitTimer, JitCheckpointer, JitOutcome
from elastic_trainer.runtime import rng
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.state.training_state import TrainingState

log = logging.getLogger(__name__)

TEARDOWN_S = 10.0
"""After a failure, the just-in-time save plus the teardown must end within ``SAVE_TIMEOUT_S +
TEARDOWN_S``; past that the process exits (code 1) instead of hanging."""

Payload = Callable[[Mapping[str, Any]], dict[str, Any]]
"""The manager's: what a checkpoint holds around ``state`` (format, fingerprint, config)."""
WriteFile = Callable[[dict[str, Any], int, int], str]
"""The manager's: write ``(payload, step, epoch)`` as a just-in-time single-file checkpoint."""


class JustInTime(JitCheckpointer):
    """The just-in-time save of one :class:`~.manager.CheckpointManager`; see the module docstring.
    Off until :meth:`setup` (the load) turns it on.

    Args:
        state: what is saved.
        env: this worker's place in the job.
        directory: the checkpoint directory (``None``: never saves).
        switch: whether the job wants the save (config, else ``ELASTIC_TRAINER_JIT_SAVE``).
        sharded: the sharded state's checkpointer (``None``: a replicated state, one file).
        writer: this process's background checkpoint writer (waited for before a save).
        payload: :data:`Payload`.
        write_file: :data:`WriteFile`.
        writing: the step of this process's periodic write in flight (``None``: none).
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
    ) -> None:
        super().__init__(
            guard=state.guard,
            directory=directory,
            rank=env.rank,
            step=lambda: state.step,
            payload=self._snapshot,
            write=self._write_step,
            drain=self._drain_writer,
            stop_deadline=self.stop_deadline,
            writing=writing,
            may_save=self._may_save_here,
            enabled=False,
            exclusive=sharded is None,  # sharded: every rank writes its own shards
        )
        self._state, self._env, self._switch = state, env, switch
        self._sharded, self._writer = sharded, writer
        self._payload_of, self._write_file = payload, write_file
        self._stop: Callable[[], float | None] = lambda: None
        self._deadline: ExitTimer | None = None
        self._shard_saver: sharded_jit.ShardedJit | None = None
        self._training_thread: int | None = None

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

    # -- the triggers (the training loop's) ---------------------------------------------------------
    def arm(self, stop_deadline: Callable[[], float | None] = lambda: None) -> None:
        """Training starts: the state now is a completed step (every rank holds the same
        buffers). ``stop_deadline``: the graceful stop's deadline (``time.monotonic()``), if one
        is running (the loop owns the stop signal)."""
        self._stop = stop_deadline
        self._state.arm()
        super().arm()

    def stop_deadline(self) -> float | None:
        """The graceful stop's deadline, if one is running (what :meth:`arm` was given)."""
        return self._stop()

    def after_failure(self, exc: BaseException) -> JitOutcome | None:
        """The training loop raised: save the last completed step just in time (bounded), and
        make sure the process ends soon after (:data:`TEARDOWN_S`)."""
        if not self.enabled:
            return None
        # Save, then let the exception end the process quickly: torchrun restarts the group
        # once all its local workers are gone. Never hang on the way.
        self._deadline = ExitTimer(
            SAVE_TIMEOUT_S + TEARDOWN_S, 1, "saving and stopping after a failure"
        )
        return super().after_failure(exc)

    def close(self) -> None:
        """Stand down, and cancel the after-failure deadline (the caller's teardown is done)."""
        self.stand_down()
        if self._deadline is not None:
            self._deadline.cancel()

    # -- what is written ------------------------------------------------------------------------------
    def _may_save_here(self) -> str | None:
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
        if self.directory is None:
            raise RuntimeError("just-in-time checkpointing needs a directory")
        if self._shard_saver is not None:
            return self._write_held_shards(self._shard_saver, step)
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

    def _write_held_shards(self, saver: sharded_jit.ShardedJit, step: int) -> str:
        """Every shard this rank holds (its own, the neighbour copy it received) as parts of a
        just-in-time checkpoint: of ``step``, or of the step before it where the dead rank's last
        copy was cut (``sharded_jit.ShardedJit``). The live state stands in for this rank's own
        shard on the training thread only; on another thread (a stalled stop, the healer's stop
        watch) the copy is stopped first, so that the training thread stages nothing new while
        the staged copies are written."""
        live = threading.get_ident() == self._training_thread
        if not live:
            saver.copies.stop()
        reason = f"the group failed after step {step}"
        outcome = saver.save(reason, deadline=time.monotonic() + SAVE_TIMEOUT_S, live=live)
        if outcome.path is not None and outcome.step == step:
            return outcome.path
        if outcome.path is not None:
            return f"{outcome.path} (step {outcome.step}: the lost rank's copy of {step} was cut)"
        return (
            f"{sharded.jit_path(self.directory or '.', step, saver.checkpointer.token)} (the "
            f"shards this rank holds: {outcome.detail}; the checkpoint counts once every rank's "
            "are in)"
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

    def _drain_writer(self, timeout: float) -> None:
        """Let this process's own background checkpoint write finish before it exits. A failed
        write is said in one line and not raised: the just-in-time save that drains it reads what
        reached the disk afterwards and writes the step itself when the write did not commit it."""
        try:
            self._writer.wait(timeout)
        except ckpt.CheckpointError as exc:
            log.warning("the background checkpoint write failed: %s", exc)
