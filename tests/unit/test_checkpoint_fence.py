"""The checkpoint manager under a commit fence: a refused periodic write changes nothing on disk
and is not reported as the last checkpoint; the same step can be saved again."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.checkpoint.manager import CONFIRM_PATIENCE_S, CheckpointManager
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


def test_a_save_due_while_the_last_one_waits_on_etcd_is_skipped_not_waited_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 40 item 7: the commit fence asks etcd (up to seconds in an outage) on the writer
    thread; once it has waited longer than etcd takes when it is up, the next periodic save, due
    meanwhile, returns at once with one line instead of holding the training thread, and the save
    after the outage is written."""
    etcd_back = threading.Event()
    asked = threading.Event()

    def fence() -> str | None:
        asked.set()
        etcd_back.wait(30)
        return None

    manager = _manager(tmp_path, async_write=True, fence=fence)
    try:
        manager.state.step = 1
        manager.save(1)
        assert asked.wait(10), "the writer asks the fence"
        time.sleep(CONFIRM_PATIENCE_S)  # longer than etcd takes when it is up
        manager.state.step = 2
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="elastic_trainer.checkpoint.manager"):
            manager.save(2)
        assert time.monotonic() - started < 1.0, "the training thread did not wait"
        assert "checkpoint of step 2 skipped" in caplog.text
        etcd_back.set()
        manager.just_in_time._drain(10.0)
        manager.state.step = 3
        manager.save(3)
        manager.just_in_time._drain(10.0)
        assert ckpt.iter_checkpoints(tmp_path) == [1, 3]
    finally:
        etcd_back.set()
        manager.close(5.0)


def test_a_save_due_while_etcd_answers_the_last_commit_in_time_waits_for_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The skip is for an outage only: a fence that answers within its patience (etcd up, a
    busy moment) holds the next save until it is done, and every due step is written."""
    answered = threading.Event()

    def fence() -> str | None:
        time.sleep(CONFIRM_PATIENCE_S / 4)
        answered.set()
        return None

    manager = _manager(tmp_path, async_write=True, fence=fence)
    try:
        manager.state.step = 1
        manager.save(1)
        manager.state.step = 2
        with caplog.at_level("WARNING", logger="elastic_trainer.checkpoint.manager"):
            manager.save(2)
        assert answered.is_set(), "the second save went ahead before the first was confirmed"
        manager.just_in_time._drain(10.0)
        assert "skipped" not in caplog.text
        assert ckpt.iter_checkpoints(tmp_path) == [1, 2]
    finally:
        manager.close(5.0)


def test_a_refusal_that_comes_before_the_save_returns_still_leaves_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    """The writer thread can run the fence, be refused and report it before the training thread
    that submitted the write has set ``last_path`` (a loaded machine did, in a whole-suite run
    with two busy processes beside it): the refusal must win whatever the order."""
    refuse = [False]
    manager = _manager(
        tmp_path,
        async_write=True,
        fence=lambda: "the job went on without this process" if refuse[0] else None,
    )
    submit = manager._write

    def write_then_let_the_writer_finish(*args: Any, **kwargs: Any) -> Any:
        path = submit(*args, **kwargs)
        manager._writer.wait(10.0)  # the refusal is reported before this save goes on
        return path

    manager._write = write_then_let_the_writer_finish  # type: ignore[method-assign]
    try:
        manager.state.step = 1
        first = manager.save(1)
        manager.just_in_time._drain(10.0)
        refuse[0] = True
        manager.state.step = 2
        manager.save(2)
        assert ckpt.iter_checkpoints(tmp_path) == [1], "nothing committed"
        assert manager.last_path == first, "the last checkpoint is still step 1's"
    finally:
        manager.close(5.0)
