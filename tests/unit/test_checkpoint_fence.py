"""The checkpoint manager under a commit fence: a refused periodic write changes nothing on disk
and is not reported as the last checkpoint; the same step can be saved again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.checkpoint.manager import CheckpointManager
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.settings import WorkerSettings

ENV = DistEnv(
    rank=0,
    local_rank=0,
    world_size=1,
    local_world_size=1,
    restart_count=0,
    launched=False,
    device=torch.device("cpu"),
    backend="gloo",
)


def _manager(tmp_path: Path, *, async_write: bool, **options: Any) -> CheckpointManager:
    """A manager of a small model's checkpoints in ``tmp_path``, every step."""
    model = nn.Linear(3, 2)
    return CheckpointManager(
        CheckpointConfig(directory=str(tmp_path), every=1, async_write=async_write),
        env=ENV,
        states={"model": model},
        fingerprint={"model": ckpt.model_signature(model.state_dict())},
        settings=WorkerSettings(),
        **options,
    )


@pytest.mark.parametrize("async_write", [True, False])
def test_a_refused_write_is_not_the_last_checkpoint(tmp_path: Path, async_write: bool) -> None:
    refuse = [False]
    manager = _manager(
        tmp_path,
        async_write=async_write,
        fence=lambda: "the job went on without this process" if refuse[0] else None,
    )
    try:
        manager.state.step = 1
        first = manager.save(1)
        manager.just_in_time._drain(10.0)  # the background write, if any
        assert first is not None and ckpt.iter_checkpoints(tmp_path) == [1]

        refuse[0] = True
        manager.state.step = 2
        manager.save(2)
        manager.just_in_time._drain(10.0)  # the background write, if any
        assert ckpt.iter_checkpoints(tmp_path) == [1], "nothing committed"
        assert manager.last_path == first, "the last checkpoint is still step 1's"
        assert not manager.write_failed, "a refusal is no write failure"

        refuse[0] = False  # etcd confirms again: the same step is saved, not skipped
        again = manager.save(2)
        manager.just_in_time._drain(10.0)  # the background write, if any
        assert (
            ckpt.iter_checkpoints(tmp_path) == [1, 2]
            and again is not None
            and again.endswith("000000000002.pt")
        )
    finally:
        manager.close(5.0)


def test_draining_a_failed_background_write_says_so_and_does_not_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The just-in-time save drains the periodic write before it looks at the disk; a write that
    failed is one warning there, not an exception that would stop the save."""
    manager = _manager(tmp_path, async_write=True)
    try:

        def failing() -> ckpt.CheckpointInfo:
            raise OSError(28, "No space left on device")

        manager._writer.submit(failing)
        with caplog.at_level("WARNING", logger="elastic_trainer.checkpoint.jit"):
            manager.just_in_time._drain(10.0)
        assert "the background checkpoint write failed" in caplog.text
        assert "No space left on device" in caplog.text
        assert ckpt.iter_checkpoints(tmp_path) == []
    finally:
        manager.close(5.0)
