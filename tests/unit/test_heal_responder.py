"""The heal responder exists only while a round is to be handled: a round-open event from the
watch starts it, it handles the rounds in the order they opened, and it ends once none is left
(issue 30: a healthy step runs no thread for it)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from elastic_trainer.heal.membership import HealKeys, Membership
from elastic_trainer.heal.protocol import Member, RoundRules

pytestmark = pytest.mark.timeout(30)


class _Delete:
    """The watch's delete event type (none are sent here)."""


def _membership(handled: list[tuple[int, str, str]], gate: threading.Event) -> Membership:
    def on_round_open(number: int, reason: str) -> None:
        handled.append((number, reason, threading.current_thread().name))
        gate.wait(10)

    connection: Any = SimpleNamespace(
        etcd3=SimpleNamespace(events=SimpleNamespace(DeleteEvent=_Delete))
    )
    return Membership(
        connection,
        "job",
        Member(id="m0", slot="node-0/0"),
        RoundRules(min_world=1, max_world=2),
        on_round_open=on_round_open,
    )


def _opened(number: int, reason: str, revision: int) -> Any:
    """What the watch delivers when round ``number`` is opened."""
    return SimpleNamespace(
        key=HealKeys.of("job").open(number).encode(),
        value=f"m1 {reason}".encode(),
        mod_revision=revision,
        create_revision=revision,
    )


def _responders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "heal-responder"]


def _wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_the_responder_runs_only_while_rounds_are_to_be_handled() -> None:
    handled: list[tuple[int, str, str]] = []
    gate = threading.Event()
    membership = _membership(handled, gate)
    assert _responders() == [], "no responder before a round opened"
    membership._on_events([_opened(3, "lost", 10)])  # on the watch thread, in a real process
    assert _wait_for(lambda: len(handled) == 1)
    membership._on_events([_opened(4, "again", 11)])  # while round 3 is still being handled
    assert len(_responders()) == 1, "one responder at a time: rounds are handled in order"
    gate.set()
    assert _wait_for(lambda: len(handled) == 2)
    assert [(n, r) for n, r, _ in handled] == [(3, "lost"), (4, "again")]
    assert {name for _, _, name in handled} == {"heal-responder"}
    assert _wait_for(lambda: _responders() == []), "the responder ends once nothing is left"
    membership._on_events([_opened(5, "third", 12)])  # a later round starts one again
    assert _wait_for(lambda: len(handled) == 3 and _responders() == [])
    membership.close()
    membership._on_events([_opened(6, "closed", 13)])
    time.sleep(0.1)
    assert len(handled) == 3 and _responders() == [], "nothing is handled after close"
