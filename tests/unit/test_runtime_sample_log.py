"""Unit tests of the sample audit log and the rollback-aware committed history."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_trainer.runtime.sample_log import SampleLog, committed_history, read_records

pytestmark = pytest.mark.timeout(30)


def _process(
    tmp: Path, rank: int, generation: str, started: float, resumed: int, steps: range
) -> None:
    log = SampleLog(tmp, rank=rank, pid=int(started))  # a process per (rank, generation)
    log.start(
        generation=generation, started_unix=started, resumed_step=resumed, world_size=2, rank=rank
    )
    for step in steps:
        log.step(
            step=step,
            epoch=0,
            cursor=(step - 1) * 4,
            world_size=2,
            rank=rank,
            indices=[(step - 1) * 4 + 2 * rank, (step - 1) * 4 + 2 * rank + 1],
        )
    log.close()


def test_rolled_back_steps_are_replaced_by_the_restarted_generation(tmp_path: Path) -> None:
    for rank in (0, 1):
        _process(tmp_path, rank, "first", 100.0, 0, range(1, 8))  # crashed after step 7
        _process(
            tmp_path, rank, "second", 200.0, 5, range(6, 11)
        )  # resumed from the step-5 checkpoint
    history = committed_history(read_records(tmp_path))
    assert sorted(history) == list(range(1, 11))
    assert all(len(records) == 2 for records in history.values())
    indices = sorted(i for records in history.values() for r in records for i in r["indices"])
    assert indices == list(range(40))  # exactly once, although steps 6-7 ran twice


def test_a_torn_last_line_is_ignored(tmp_path: Path) -> None:
    _process(tmp_path, 0, "g", 1.0, 0, range(1, 3))
    path = next(tmp_path.glob("*.jsonl"))
    with open(path, "a") as f:
        f.write('{"event": "step", "st')  # SIGKILL mid-write
    (records,) = read_records(tmp_path)
    assert [r["event"] for r in records] == ["start", "step", "step"]


def test_a_generation_that_started_no_step_rolls_nothing_back(tmp_path: Path) -> None:
    """A joiner that formed a group alone from the step-5 checkpoint (its peer unreachable), then
    healed into a group that took a survivor's state of step 7 before either trained: steps 6-7
    of the first generation are in the model, and must stay in the history."""
    for rank in (0, 1):
        _process(tmp_path, rank, "first", 100.0, 0, range(1, 8))
    _process(tmp_path, 0, "alone", 150.0, 5, range(0))  # loaded step 5, trained nothing
    for rank in (0, 1):
        _process(tmp_path, rank, "healed", 200.0 + rank, 7, range(8, 11))  # from a peer's step 7
    history = committed_history(read_records(tmp_path))
    assert sorted(history) == list(range(1, 11))
    assert all(len(records) == 2 for records in history.values())
