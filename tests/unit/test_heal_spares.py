"""A process outside a full epoch waits as a spare and opens no round (``Healer._round``, with a
fake membership: no etcd, no process group).

The livelock these tests pin down (seen at load 12-18, reproduced with the spares' node at the
lowest CPU priority): a round closed without two live processes that held state (they answered
after ``settle_s``), the epoch was full without them, and each of them opened the next round to
get in. Every such round closed full again (the previous epoch's slots come first) and broke the
members' new group: over 400 rounds in 40 s, no step trained. A spare that woke after its round
had already closed did the same."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from elastic_trainer.heal.healer import MAX_HEAL_ROUNDS, Healer, HealError, RunFinished
from elastic_trainer.heal.membership import HealTimeoutError
from elastic_trainer.heal.protocol import NO_STATE, Epoch, Join, Member, RoundRules

pytestmark = pytest.mark.timeout(30)


def member(node: str, local: int) -> Member:
    return Member(id=f"{node}/{local}/{hash((node, local)) % 1000}", slot=f"{node}/{local}")


A0, A1, B0, B1 = member("a", 0), member("a", 1), member("b", 0), member("b", 1)
ME = member("c", 0)
"""The process under test (a third node's worker)."""


def epoch(number: int, *members: Member, finished: bool = False) -> Epoch:
    return Epoch(
        number=number,
        members=members,
        step=NO_STATE,
        source=None,
        started_unix=0.0,
        reason="r",
        finished=finished,
    )


class FakeJob:
    """The etcd side as one process sees it: the current epoch, the rounds opened, this process's
    answers. A round closes (``settle``) with ``members_for(n)``; ``on_wait`` is what happens while
    this process waits as a spare (the test's script of the other processes)."""

    def __init__(self, current: Epoch, *, members_for: Callable[[int], tuple[Member, ...]]) -> None:
        self.current = current
        self.members_for = members_for
        self.rules = RoundRules(min_world=2, max_world=4)
        self.opened_by_me: list[int] = []
        self.opened_by_others: set[int] = set()
        self.answered: list[tuple[int, int]] = []
        self.waits = 0
        self.on_wait: Callable[[int], None] = lambda n: self.finish()

    @property
    def epoch(self) -> Epoch:
        return self.current

    def finish(self) -> None:
        self.current = epoch(self.current.number, *self.current.members, finished=True)

    def others_open(self, number: int) -> None:
        self.opened_by_others.add(number)

    def round_open(self, number: int) -> bool:
        return number in self.opened_by_others or number in self.opened_by_me

    def open_round(self, number: int, reason: str) -> None:
        self.opened_by_me.append(number)

    def answer(self, number: int, join: Join) -> None:
        self.answered.append((number, join.step))

    def settle(self, number: int, *, deadline: float, reason: str, stop: Any = None) -> Epoch:
        if time.monotonic() >= deadline:
            raise HealTimeoutError(f"round {number} did not close")
        self.current = epoch(number, *self.members_for(number))
        return self.current

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        self.waits += 1
        if self.waits > 20:
            raise AssertionError("the spare's wait never ended: the script is wrong")
        self.on_wait(self.waits)
        return predicate()


def healer_over(job: FakeJob, *, timeout_s: float = 600.0) -> Healer:
    """A healer whose membership is ``job`` and whose group formation returns the epoch."""
    healer = Healer.__new__(Healer)
    healer.settings = SimpleNamespace(timeout_s=timeout_s)  # type: ignore[assignment]
    healer.membership = job  # type: ignore[assignment]
    healer.member = ME
    healer._phase, healer._phase_lock, healer._group_aborted = "healing", threading.Lock(), False
    healer.stop_requested = None
    healer.group = SimpleNamespace(destroy=lambda: None)  # type: ignore[assignment]
    healer._enter = lambda env, e, rank, **_: (e, rank)  # type: ignore[assignment,method-assign]
    return healer


def heal(healer: Healer, *, step: int, started: float | None = None) -> Any:
    return healer._round(
        None,  # type: ignore[arg-type]
        step=step,
        snapshot=None,
        reason="a collective failed",
        started=time.monotonic() if started is None else started,
    )


def test_a_process_left_out_of_a_full_epoch_waits_as_a_spare_and_opens_no_round() -> None:
    """Epoch 4 formed without this process (it answered round 4 late, holding step 42) and is
    full: it waits as a spare until something happens (here the job ends), and opens nothing.
    Before, it opened round 5, round 5 closed full without it again, it opened round 6..."""
    job = FakeJob(epoch(3, A0, A1, ME, B1), members_for=lambda n: (A0, A1, B0, B1))
    job.others_open(4)
    with pytest.raises(RunFinished):
        heal(healer_over(job, timeout_s=2.0), step=42)
    assert job.answered == [(4, 42)]
    assert job.opened_by_me == [], "a process outside a full epoch opened a round"
    assert job.waits == 1


def test_a_spare_that_missed_a_round_does_not_open_the_next() -> None:
    """A spare (no state) of a full epoch 2; while it waits, round 3 opens and closes without it
    (its thread woke too late on a loaded machine): it goes on waiting, it does not open round 4.
    Two such spares used to open one round after another, each breaking the members' group."""
    job = FakeJob(epoch(2, A0, A1, B0, B1), members_for=lambda n: (A0, A1, B0, B1))

    def others(n: int) -> None:
        if n == 1:
            job.current = epoch(3, A0, A1, B0, B1)  # round 3 opened and closed meanwhile
        else:
            job.finish()

    job.on_wait = others
    with pytest.raises(RunFinished):
        heal(healer_over(job), step=NO_STATE)
    assert job.opened_by_me == []
    assert job.waits == 2


def test_a_spare_joins_the_round_it_waited_for_with_a_heal_time_of_its_own() -> None:
    """A spare's heal starts when its round opens, not when it began to wait: a spare that waited
    longer than the heal timeout still takes its place (b0 died, round 3 opened by b1)."""
    job = FakeJob(epoch(2, A0, A1, B0, B1), members_for=lambda n: (A0, A1, ME, B1))

    def b0_dies(n: int) -> None:
        time.sleep(0.3)  # longer than the heal timeout below
        job.others_open(3)

    job.on_wait = b0_dies
    entered, rank = heal(healer_over(job, timeout_s=0.2), step=NO_STATE)
    assert (entered.number, rank) == (3, 2)
    assert job.answered == [(3, NO_STATE)] and job.opened_by_me == []


def test_a_heal_that_never_forms_gives_up_after_a_bounded_number_of_rounds() -> None:
    """Every epoch this member forms breaks at once (a peer keeps failing): after
    MAX_HEAL_ROUNDS rounds the heal gives up with one line, well before its timeout, and the
    process takes the restart path."""
    job = FakeJob(epoch(3, A0, A1, B0, ME), members_for=lambda n: (A0, A1, B0, ME))
    healer = healer_over(job)

    def breaks(env: Any, e: Epoch, rank: int, **_: Any) -> Any:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")

    healer._enter = breaks  # type: ignore[assignment,method-assign]
    with pytest.raises(HealError, match=rf"{MAX_HEAL_ROUNDS} round\(s\) in .* formed no epoch"):
        heal(healer, step=7)
    assert len(job.answered) == MAX_HEAL_ROUNDS
