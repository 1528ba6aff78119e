"""Checkpoints of a sharded (FSDP2) job, in one object a training loop calls.

    state = ShardedState(model, [optimizer], objects={"sampler": sampler})
    manager = ShardedCheckpointManager(CheckpointConfig(directory="/ckpt", every=100), env=env,
                                       state=state, fingerprint={"model": ..., "seed": 0})
    step = manager.load() or 0              # collective: rank 0 chooses, every rank reads its shards
    ...
    if manager.due(step):
        manager.save(step)                  # collective; asynchronous: costs the staging copy
    manager.save(step, final=True)          # collective; synchronous, every rank learns the outcome
    manager.close()

    with manager.just_in_time(copies, enabled=not attempt.heals_in_place):
        ...                                 # a failure, or a stop signal: every shard held is saved

The resume choice (newest good checkpoint of this job, fallback, quarantine, another job refused)
is :func:`.files.choose_resume`, as for DDP jobs; the files are those of :mod:`.sharded`. Every
rank writes its own shards, so every save is collective (a DDP job's periodic save is rank 0's
alone). A checkpoint written at N ranks loads at M.

:meth:`ShardedCheckpointManager.just_in_time` is the save of a job that a fault restarts (plain
torchrun, ``--heal off``): when training raises (a peer died), or a stop signal arrives (torchrun
stops the survivors; the training thread may be stuck in a collective), every rank writes the
shards it holds in host memory, its own and its neighbour copies, with no collective
(``checkpoint/sharded_jit.py``), and exits; the set of the last completed step is committed as a
checkpoint even without the dead rank, whose shards come from its neighbour's copy. Design:
``docs/design/sharded.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint import sharded, sharded_jit
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.checkpoint.jit import (
    BACKSTOP_S,
    SAVE_TIMEOUT_S,
    ExitTimer,
    JitOutcome,
    flush_logs,
)
from elastic_trainer.runtime import rng
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.exit_codes import EXIT_STOPPED
from elastic_trainer.runtime.failures import log_line
from elastic_trainer.runtime.settings import WorkerSettings
from elastic_trainer.runtime.signals import STOP_SIGNALS, SignalWakeup
from elastic_trainer.state.neighbour_copy import NeighbourCopy
from elastic_trainer.state.sharded import ShardedState

log = logging.getLogger(__name__)


class ShardedCheckpointManager:
    """See the module docstring. Constructing it is collective (the checkpoint's process group).

    Args:
        config: the checkpoint section (``jit_save`` does not apply: see the module docstring).
        env: this worker's place in the job.
        state: the sharded state to save and restore.
        fingerprint: what identifies the job; another job's checkpoint is refused.
        fence: asked right before every commit (see :func:`.files.save_checkpoint`).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        env: DistEnv,
        state: ShardedState,
        fingerprint: Mapping[str, Any],
        fence: ckpt.CommitFence | None = None,
    ) -> None:
        self.config = config
        self.env = env
        self.state = state
        self.fingerprint_fields = dict(fingerprint)
        self.step = 0
        """Optimizer steps completed, as of the last :meth:`load` or :meth:`save`."""
        self.epoch = 0
        self.resumed_from: int | None = None
        self._last_saved: int | None = None
        self.checkpointer = (
            None
            if config.directory is None
            else sharded.ShardedCheckpointer.for_job(
                config, env=env, fingerprint_fields=self.fingerprint_fields, fence=fence
            )
        )

    @property
    def directory(self) -> str | None:
        return self.config.directory

    def due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due after ``step``."""
        return self.directory is not None and step % self.config.every == 0

    def _payload(self, step: int, epoch: int) -> dict[str, Any]:
        payload = self.state.state_dict()
        payload.update(
            {
                "format": ckpt.FORMAT,
                "step": step,
                "epoch": epoch,
                "rng": {"scheme": rng.STEP_SCHEME, "seed": self.fingerprint_fields.get("seed")},
            }
        )
        return payload

    def load(self) -> int | None:
        """Collective: restore the newest good checkpoint of this job, resharded onto this world;
        returns its step (``None``: none, start from scratch).

        Raises:
            CheckpointMismatchError: the directory holds another job's checkpoints.
            CheckpointError: the directory cannot be used, or the checkpoint does not load.
        """
        decision: list[Any] = [None]
        if self.directory is not None and self.env.is_rank0:
            # Before the choice removes them: a just-in-time set that never completed.
            lost = sharded_jit.describe_incomplete(self.directory, ckpt.newest_step(self.directory))
            decision[0] = ckpt.choose_resume(self.directory, self.fingerprint_fields)
            if lost is not None:
                log.warning("%s", lost)
        if self.env.world_size > 1:
            dist.broadcast_object_list(decision, src=0)
        value = ckpt.chosen_path(decision[0])
        if value is None or self.checkpointer is None:
            if self.env.is_rank0:
                log.info("starting from scratch (no usable checkpoint in %s)", self.directory)
            return None
        started = time.monotonic()
        payload = self._payload(0, 0)
        sharded.load_into(Path(value), payload, group=self.checkpointer.group)
        self.state.load_state_dict(payload)
        self.step = self.resumed_from = self._last_saved = int(payload["step"])
        self.epoch = int(payload["epoch"])
        if self.env.is_rank0:
            jit = sharded_jit.written_just_in_time(Path(value))
            log.info(
                "resumed from %s%s (step %d, epoch %d, now %d ranks) in %.2f s; resharded by DCP",
                value,
                " (a just-in-time checkpoint)" if jit else "",
                self.step,
                self.epoch,
                self.env.world_size,
                time.monotonic() - started,
            )
        return self.step

    def save(self, step: int, *, epoch: int = 0, final: bool = False) -> None:
        """Collective: checkpoint the state after ``step``.

        Periodic saves are asynchronous (``async_write``, the default): they return once this
        rank's shards are staged; a failed write raises at the next save or :meth:`close`.
        ``final`` saves are synchronous, and rank 0 tells every rank whether the commit succeeded.

        Raises:
            CheckpointWriteError: this (final) write or an earlier background write failed.
        """
        if self.checkpointer is None or self._last_saved == step:
            return
        self.step, self.epoch = step, epoch
        payload = self._payload(step, epoch)
        if not final and self.config.async_write:
            self.checkpointer.save(payload, step=step, epoch=epoch)
            self._last_saved = step
            return
        outcome: list[Any] = [None]
        try:
            self.checkpointer.save(payload, step=step, epoch=epoch, sync=True)
        except ckpt.CheckpointFencedError as exc:
            log.warning("%s", exc)
        except ckpt.CheckpointError as exc:
            outcome[0] = str(exc)
        if self.env.world_size > 1:
            dist.broadcast_object_list(outcome, src=0, group=self.checkpointer.group)
        if outcome[0] is not None:
            raise ckpt.CheckpointWriteError(outcome[0])
        self._last_saved = step

    def close(self, timeout: float | None = None) -> None:
        """Wait for the background write (re-raising its error)."""
        if self.checkpointer is not None:
            self.checkpointer.wait(timeout)

    # -- the just-in-time save (a job that a fault restarts) ---------------------------------------
    def _jit_extras(self, step: int, part: Mapping[str, Any]) -> dict[str, Any]:
        """The entries a save adds to the state (:meth:`_payload`), for a part of ``step``: the
        epoch is the sampler's there (``sharded_jit.part_epoch``)."""
        return {
            "format": ckpt.FORMAT,
            "step": step,
            "epoch": sharded_jit.part_epoch(part, self.epoch),
            "rng": {"scheme": rng.STEP_SCHEME, "seed": self.fingerprint_fields.get("seed")},
        }

    def _jit_wanted(self, enabled: bool) -> bool:
        if not enabled or self.checkpointer is None:
            return False
        wanted = self.config.jit_save
        if wanted is None:
            wanted = WorkerSettings.from_environ().jit_save
        if not wanted and self.env.is_rank0:
            log.info(
                "just-in-time checkpoints are off (jit_save=False or ELASTIC_TRAINER_JIT_SAVE=0)"
            )
        return bool(wanted)

    @contextlib.contextmanager
    def just_in_time(self, copies: NeighbourCopy, *, enabled: bool = True) -> Iterator[None]:
        """Around training in a job that a fault restarts (``enabled``: no heal in place):

        - the block raises (a peer died; not a checkpoint error): every shard this rank holds
          is written as part of a just-in-time checkpoint of the newest step held everywhere
          (``checkpoint/sharded_jit.py``), within :data:`SAVE_TIMEOUT_S`, then the error goes on;
        - SIGTERM/SIGINT (torchrun stopping the survivors, or the job): the same on another
          thread (the training thread may be blocked in a collective: the parts come from the
          copies staged in host memory), once the training thread has staged the step under way
          (``NeighbourCopy.stop_after_update``: at most three recent steps, 0.5-5 s), then the
          process exits with 128 + the signal.

        A stop signal no longer ends the process before it has saved. ``copies`` is this
        attempt's neighbour copy (``Attempt.copy_shards``); with the copy off there is nothing in
        host memory to save on the signal path, and a failure saves this rank's live shards.
        """
        if not self._jit_wanted(enabled) or self.checkpointer is None:
            yield
            return
        self.state.checkpoint_names()  # on this thread: a save may run on another one
        saver = sharded_jit.ShardedJit(
            self.checkpointer, self.state, copies, extras=self._jit_extras
        )
        stop = _SaveOnSignal(saver)
        stop.install()
        try:
            yield
        except Exception as exc:
            if isinstance(exc, ckpt.CheckpointError):
                log.info("no just-in-time save after a checkpoint error (%s)", log_line(exc))
                raise
            log.warning("training failed (%s); saving the shards held just in time", log_line(exc))
            copies.stop()  # this thread stages nothing more: a stop signal need not wait for it
            timer = ExitTimer(SAVE_TIMEOUT_S + 1.0, 1, "the just-in-time checkpoint")
            try:
                saver.save(
                    f"after {log_line(exc)}",
                    deadline=time.monotonic() + SAVE_TIMEOUT_S,
                    live=True,
                )
            finally:
                timer.cancel()
            raise
        finally:
            stop.uninstall()


class _SaveOnSignal:
    """While installed: SIGTERM/SIGINT no longer end the process at once; the just-in-time save
    runs on a thread of its own (the training thread may be blocked in a collective), then the
    process exits with 128 + the signal."""

    def __init__(self, saver: sharded_jit.ShardedJit) -> None:
        self._saver = saver
        self._previous: dict[int, Any] = {}
        self._wakeup = SignalWakeup(self._on_signal)
        self._started = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread: a stop signal will not save the shards held")
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._noted)
        self._wakeup.install()

    def uninstall(self) -> None:
        self._wakeup.uninstall()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @staticmethod
    def _noted(signum: int, frame: FrameType | None) -> None:
        """(Main thread) the wakeup thread acts on it; nothing to do here."""

    def _on_signal(self, signum: int) -> None:
        if self._started:
            return
        self._started = True
        threading.Thread(
            target=self._save_and_exit, args=(signum,), name="jit-on-signal", daemon=True
        ).start()

    def _save_and_exit(self, signum: int) -> None:
        name = signal.Signals(signum).name
        log.warning("received %s: saving the shards held just in time, then exiting", name)
        code = EXIT_STOPPED if signum == signal.SIGTERM else 128 + signum
        copies = self._saver.copies
        finish = copies.finish_timeout()
        ExitTimer(finish + SAVE_TIMEOUT_S + BACKSTOP_S, code, f"the just-in-time save on {name}")
        # The step under way is staged first (every rank got the signal within milliseconds, some
        # inside that step's update), then the newest staged step stays the newest completed.
        if not copies.stop_after_update(finish) and copies.mode != "off":
            log.info("the step under way did not end within %.1f s; saving what is staged", finish)
        outcome: JitOutcome = self._saver.save(name, deadline=time.monotonic() + SAVE_TIMEOUT_S)
        log.info("just-in-time save on %s: %s", name, outcome.detail or outcome.path)
        flush_logs()
        os._exit(code)
