"""Trainer configurations for tests, written flat."""

from __future__ import annotations

from typing import Any

from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.train.config import TrainerConfig

_CHECKPOINT_KEYS = {
    "checkpoint_dir": "directory",
    "checkpoint_every": "every",
    "keep_last": "keep_last",
    "async_checkpoint": "async_write",
    "jit_save": "jit_save",
}


def trainer_config(**values: Any) -> TrainerConfig:
    """A :class:`TrainerConfig` from flat keyword values: ``checkpoint_dir``, ``checkpoint_every``,
    ``keep_last``, ``async_checkpoint`` and ``jit_save`` go to its checkpoint section."""
    section = {_CHECKPOINT_KEYS[k]: values.pop(k) for k in list(values) if k in _CHECKPOINT_KEYS}
    return TrainerConfig(checkpoint=CheckpointConfig(**section), **values)
