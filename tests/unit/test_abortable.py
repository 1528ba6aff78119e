"""Tracked waits: completed by their collective or failed by an abort, whichever comes first, once."""

from __future__ import annotations

import pytest
import torch

from elastic_trainer.runtime.abortable import ABORT_MARKER, AbortableWaits
from elastic_trainer.runtime.failures import is_collective_failure as is_group_failure


def test_off_it_hands_back_the_future_it_was_given() -> None:
    waits = AbortableWaits()
    future: torch.futures.Future[int] = torch.futures.Future()
    assert waits.track(future) is future


def test_a_tracked_future_passes_on_the_value_or_the_error() -> None:
    waits = AbortableWaits()
    waits.enabled = True
    ok, bad = torch.futures.Future(), torch.futures.Future()
    tracked_ok, tracked_bad = waits.track(ok), waits.track(bad)
    assert tracked_ok is not ok and not tracked_ok.done()
    ok.set_result(7)
    assert tracked_ok.wait() == 7
    bad.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        tracked_bad.wait()
    assert waits.abort("nothing pending") == 0 and waits.reset() == 0


def test_an_abort_fails_what_is_pending_and_the_late_collective_changes_nothing() -> None:
    waits = AbortableWaits()
    waits.enabled = True
    stuck, finished = torch.futures.Future(), torch.futures.Future()
    tracked_stuck, tracked_finished = waits.track(stuck), waits.track(finished)
    finished.set_result("done")
    assert waits.abort("round 4 opened") == 1
    with pytest.raises(RuntimeError, match=f"{ABORT_MARKER} \\(round 4 opened\\)") as raised:
        tracked_stuck.wait()
    assert is_group_failure(raised.value), "the training thread heals, as from any group failure"
    assert tracked_finished.wait() == "done"
    stuck.set_result("too late")  # the blocked collective ends after all: no second completion
    with pytest.raises(RuntimeError, match=ABORT_MARKER):
        tracked_stuck.wait()
    late = waits.track(torch.futures.Future())  # a bucket launched after the abort, same group
    with pytest.raises(RuntimeError, match=f"{ABORT_MARKER} \\(round 4 opened\\)"):
        late.wait()
    assert waits.reset() == 2, "the group had interrupted waits (it is kept, not destructed)"
    assert waits.reset() == 0
    fresh, source = None, torch.futures.Future()
    fresh = waits.track(source)  # the next group's waits are not aborted
    source.set_result(1)
    assert fresh.wait() == 1


@pytest.mark.parametrize("enabled", [False, True])
def test_then_runs_once_on_the_value_as_future_then_would(enabled: bool) -> None:
    waits = AbortableWaits()
    waits.enabled = enabled
    calls: list[int] = []

    def then(done: torch.futures.Future[int]) -> int:
        calls.append(1)
        return done.value() * 10

    ok, bad = torch.futures.Future(), torch.futures.Future()
    tracked_ok, tracked_bad = waits.track(ok, then), waits.track(bad, then)
    ok.set_result(4)
    assert tracked_ok.wait() == 40
    bad.set_exception(RuntimeError("Connection reset by peer"))
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        tracked_bad.wait()
    assert calls == [1, 1]


def test_after_an_abort_then_never_runs() -> None:
    waits = AbortableWaits()
    waits.enabled = True
    calls: list[int] = []
    stuck = torch.futures.Future()
    tracked = waits.track(stuck, lambda done: calls.append(1))
    waits.abort("round 5 opened")
    stuck.set_result(1)
    with pytest.raises(RuntimeError, match=ABORT_MARKER):
        tracked.wait()
    assert calls == []
