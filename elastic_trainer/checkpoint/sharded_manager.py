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

The resume choice (newest good checkpoint of this job, fallback, quarantine, another job refused)
is :func:`.files.choose_resume`, as for DDP jobs; the files are those of :mod:`.sharded`. Every
rank writes its own shards, so every save is collective (a DDP job's periodic save is rank 0's
alone). A checkpoint written at N ranks loads at M. This manager has no just-in-time save; the
``CheckpointManager`` of ``Elastic`` and the ``Trainer`` has one for sharded state
(``docs/design/sharded.md``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint import sharded
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.runtime import rng
from elastic_trainer.runtime.distributed import DistEnv
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
            decision[0] = ckpt.choose_resume(self.directory, self.fingerprint_fields)
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
            log.info(
                "resumed from %s (step %d, epoch %d, now %d ranks) in %.2f s; resharded by DCP",
                value,
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
