"""The checkpoint section of a job's configuration, read once by the
:class:`~elastic_trainer.checkpoint.manager.CheckpointManager`."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.runtime.settings import check_bool, check_positive_int

DEFAULT_CHECKPOINT_EVERY = 100


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Where and how often checkpoints are written, and how failures are saved."""

    directory: str | None = None
    """Directory shared by all nodes. ``None``: no checkpoints, and the job is not fault tolerant
    (a restart starts from step 0; the manager says so in one line)."""
    every: int = DEFAULT_CHECKPOINT_EVERY
    """Write a checkpoint every this many optimizer steps (and at the end, and on SIGTERM)."""
    keep_last: int = 3
    """Checkpoints kept on disk; older ones are deleted after a newer one is safely written."""
    async_write: bool = True
    """Periodic checkpoints: copy the state into reused host buffers (pinned on CUDA, without
    waiting for the GPU) and write the file on a background thread, at most one write in flight.
    ``False``: rank 0 writes while the others train on. Final and SIGTERM checkpoints are written at
    once, always."""
    jit_save: bool | None = None
    """When the group fails, a surviving rank saves the last completed step, so at most one step is
    redone. ``None``: ``ELASTIC_TRAINER_JIT_SAVE`` (default on). See :mod:`elastic_trainer.checkpoint.jit`."""

    def __post_init__(self) -> None:
        if self.directory is not None and not str(self.directory).strip():
            raise ConfigError(
                "checkpoint.directory: must be a directory path or unset, got an empty string"
            )
        check_positive_int("checkpoint.every", self.every)
        check_positive_int("checkpoint.keep_last", self.keep_last)
        check_bool("checkpoint.async_write", self.async_write)
        check_bool("checkpoint.jit_save", self.jit_save, allow_none=True)
