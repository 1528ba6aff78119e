"""The coordinator's view of the round state: its own close is no reason to read the run again;
a round closed by another coordinator is (its ranks are only in etcd)."""

from __future__ import annotations

import threading

from rendezvous.coordinator import RoundCoordinator
from rendezvous.round_state import COMPLETE, RoundState


def _coordinator(*, closing: int | None) -> RoundCoordinator:
    coordinator = object.__new__(RoundCoordinator)  # only the view's state: no etcd, no thread
    coordinator._cond = threading.Condition()
    coordinator._state, coordinator._state_rev = None, 10
    coordinator._open_round, coordinator._members_round = 3, 2
    coordinator._closing = closing
    coordinator._needs_resync, coordinator._dirty = False, False
    return coordinator


def test_the_event_of_its_own_close_arriving_first_triggers_no_resync() -> None:
    coordinator = _coordinator(closing=3)
    coordinator._apply_state(RoundState(3, COMPLETE, world_size=2, shards=1), 11)
    assert coordinator._state_rev == 11 and not coordinator._needs_resync


def test_a_round_closed_by_another_coordinator_is_read_again() -> None:
    for closing in (None, 4):
        coordinator = _coordinator(closing=closing)
        coordinator._apply_state(RoundState(3, COMPLETE, world_size=2, shards=1), 11)
        assert coordinator._needs_resync
