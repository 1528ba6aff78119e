"""The close rule of the lease rendezvous, as a pure function."""

from __future__ import annotations

import pytest

from rendezvous.lease_handler import (
    COMPLETE,
    OPEN,
    RoundState,
    Snapshot,
    decide_close,
    order_participants,
    waiting_summary,
)
from rendezvous.settings import RendezvousSettings


def snapshot(joined: list[str], live: set[str], previous: list[str] | None) -> Snapshot:
    return Snapshot(10, RoundState(3, OPEN, [], previous), 9, live, {3: joined})


SETTINGS = RendezvousSettings(run_id="r", min_nodes=2, max_nodes=4, last_call_timeout=30)


@pytest.mark.parametrize(
    ("joined", "live", "previous", "waited", "expected"),
    [
        # first round: wait the last call once the minimum is in, unless the maximum is reached
        (["a", "b"], {"a", "b"}, None, 0.0, None),
        (["a", "b"], {"a", "b"}, None, 30.0, ["a", "b"]),
        (["a", "b", "c", "d"], {"a", "b", "c", "d"}, None, 0.0, ["a", "b", "c", "d"]),
        (["a"], {"a"}, None, 99.0, None),  # below the minimum: never
        # later rounds: close as soon as every live previous member is back, no last call
        (["b", "a"], {"a", "b"}, ["a", "b"], 0.0, ["a", "b"]),
        (["a"], {"a", "b"}, ["a", "b"], 0.0, None),  # b is alive and has not rejoined yet
        (["a", "c"], {"a", "c"}, ["a", "b"], 0.0, ["a", "c"]),  # b's lease expired: not awaited
        (["c", "a", "b"], {"a", "b", "c"}, ["a", "b"], 0.0, ["a", "b", "c"]),  # newcomer last
        (["a", "x"], {"a"}, ["a"], 0.0, None),  # a joined node whose lease is gone does not count
    ],
)
def test_decide_close(joined, live, previous, waited, expected) -> None:  # type: ignore[no-untyped-def]
    assert decide_close(snapshot(joined, live, previous), SETTINGS, waited) == expected


def test_ranks_stay_stable_and_newcomers_follow() -> None:
    assert order_participants(["c", "b", "a"], ["a", "b"]) == ["a", "b", "c"]
    assert order_participants(["b", "c"], ["a", "b"]) == ["b", "c"]


def test_at_most_max_nodes() -> None:
    settings = RendezvousSettings(run_id="r", min_nodes=1, max_nodes=2)
    assert decide_close(snapshot(["a", "b", "c"], {"a", "b", "c"}, ["a", "b"]), settings, 0) == [
        "a",
        "b",
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_nodes": 3, "max_nodes": 2}, "nnodes"),
        ({"lease_ttl": 1}, "lease_ttl"),
        ({"join_timeout": 0}, "join_timeout"),
    ],
)
def test_settings_validation(kwargs, message) -> None:  # type: ignore[no-untyped-def]
    base = {"run_id": "r", "min_nodes": 1, "max_nodes": 2}
    with pytest.raises(ValueError, match=message):
        RendezvousSettings(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("snap", "expected"),
    [
        (Snapshot(1, None, 0, set(), {}), "no round was open"),
        (snapshot(["a"], {"a"}, None), "1 of min 2 nodes had joined round 3"),
        (
            snapshot(["a", "b"], {"a", "b"}, None),
            "2 nodes had joined round 3 (min 2), still in the last call",
        ),
        (
            snapshot(["a", "b"], {"a", "b", "c"}, ["a", "b", "c"]),
            "1 live member(s) of the previous round had not rejoined: c",
        ),
        (
            Snapshot(
                1, RoundState(2, COMPLETE, ["p", "q", "r", "s"]), 1, {"p", "q", "r", "s", "me"}, {}
            ),
            "the job is full (4 of max 4 nodes run it); this node waited as a spare",
        ),
    ],
)
def test_the_join_timeout_says_what_was_missing(snap: Snapshot, expected: str) -> None:
    assert expected in waiting_summary(snap, SETTINGS, "me")
