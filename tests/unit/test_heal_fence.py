"""A process whose training thread never left its epoch after it told a round it lives is ended
like a crash (so that a replacement joins), never one that is healing or healed: at once when the
thread is blocked (its CPU clock stands still), after the full bound when it computes."""

from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace

import pytest

from elastic_trainer.heal import healer as healer_module
from elastic_trainer.heal.healer import Healer, thread_cpu_seconds
from elastic_trainer.heal.membership import Membership, _Round
from elastic_trainer.heal.protocol import NO_STATE, Epoch, Join, Member
from elastic_trainer.runtime.abortable import AbortableWaits
from elastic_trainer.train import elastic_group

EPOCH = Epoch(number=3, members=(Member(id="a/0/1", slot="a/0"),), step=7, source=None, started_unix=1.0,
              reason="r")  # fmt: skip


def healer_in(phase: str, epoch: Epoch, *, ready_timeout_s: float = 60.0) -> Healer:
    healer = object.__new__(Healer)  # only the fence's state: no etcd, no group
    healer._phase, healer._phase_lock, healer._epoch = phase, threading.Lock(), epoch
    healer._training_thread = None
    healer._training_ident = None
    healer.waits = AbortableWaits(enabled=True)
    healer._forming = None
    healer._hand_on, healer._hand_on_lock = None, threading.Lock()
    healer.membership = SimpleNamespace(rules=SimpleNamespace(ready_timeout_s=ready_timeout_s))  # type: ignore[assignment]
    return healer


def membership_with(joins: list[Join]) -> Membership:
    """The membership view of a process of :data:`EPOCH` that saw round 4 open with ``joins``."""
    view = object.__new__(Membership)  # only the round view: no etcd
    view.member, view._lock, view._rounds = EPOCH.members[0], threading.Condition(), {}
    view._rounds[4] = _Round(
        opened_by="b/0/2", opened_at=0.0, joins={j.member.id: j for j in joins}
    )
    return view


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    found: list[tuple[int, int]] = []
    monkeypatch.setattr(healer_module.os, "kill", lambda pid, sig: found.append((pid, sig)))
    monkeypatch.setattr(healer_module.faulthandler, "dump_traceback", lambda **_: None)
    return found


def test_a_training_thread_stuck_in_its_epoch_ends_the_process(
    kills: list[tuple[int, int]],
) -> None:
    healer_in("training", EPOCH)._fence_if_stuck(EPOCH, 4, waited_s=60.0, idle=False)
    assert kills == [(healer_module.os.getpid(), signal.SIGKILL)]


PAIR = Epoch(number=3, members=(Member(id="a/0/1", slot="a/0"), Member(id="b/0/1", slot="b/0")), step=7,
             source=None, started_unix=1.0, reason="r")  # fmt: skip


@pytest.mark.parametrize(("joins", "held"), [
    ([], NO_STATE),  # nobody answered yet
    ([Join(Member(id="b/0/2", slot="b/0"), ready=True)], NO_STATE),  # b's replacement: no state
    ([Join(Member(id="c/0/1", slot="c/0"), ready=True, step=12)], NO_STATE),  # not of the epoch: never a source
    ([Join(Member(id="b/0/1", slot="b/0"), ready=False)], NO_STATE),  # b lives but has not stopped yet
    ([Join(Member(id="b/0/1", slot="b/0"), ready=True, step=9),
      Join(Member(id="a/0/1", slot="a/0"), ready=False)], 9),  # b holds step 9; a's own answer does not count
])  # fmt: skip
def test_a_stuck_process_offers_its_state_before_it_ends(
    kills: list[tuple[int, int]], joins: list[Join], held: int
) -> None:
    """Before the stop watch ends a stuck process, the loop's offer is called with the newest step a
    ready member of the epoch holds (the loop saves its own step unless that covers it), then the
    process ends; once the loop withdrew its offer (its state may move) nothing is saved."""
    healer = healer_in("training", PAIR)
    healer.membership = membership_with(joins)
    offered: list[tuple[int, str]] = []

    def offer(step: int, reason: str) -> None:
        assert kills == [], "saved before the process ends"
        offered.append((step, reason))

    healer.offer_state(offer)
    healer._fence_if_stuck(PAIR, 4, waited_s=5.0, idle=True)
    assert offered == [(held, "stuck after round 4 opened")] and len(kills) == 1
    healer.offer_state(None)
    healer._fence_if_stuck(PAIR, 4, waited_s=5.0, idle=True)
    assert len(offered) == 1 and len(kills) == 2


def test_a_process_stuck_building_the_next_group_offers_its_state_too(
    kills: list[tuple[int, int]],
) -> None:
    """Stuck building epoch 3's group when round 4 opens: the state it held has not moved (a heal
    only reads the model), so it is offered, against what the members of epoch 3 answered."""
    healer = healer_in("healing", PAIR)
    healer._forming = 3
    healer.membership = membership_with([Join(Member(id="b/0/1", slot="b/0"), ready=True, step=5)])
    healer.membership._epoch = PAIR  # the epoch being built is the membership's newest
    offered: list[int] = []
    healer.offer_state(lambda held, reason: offered.append(held))
    healer._fence_if_stuck(None, 4, waited_s=5.0, idle=True, forming=3)
    assert offered == [5] and len(kills) == 1


def test_a_failing_offer_still_ends_the_process(kills: list[tuple[int, int]]) -> None:
    healer = healer_in("training", PAIR)
    healer.membership = membership_with([])

    def offer(step: int, reason: str) -> None:
        raise OSError("disk full")

    healer.offer_state(offer)
    healer._fence_if_stuck(PAIR, 4, waited_s=5.0, idle=True)
    assert kills == [(healer_module.os.getpid(), signal.SIGKILL)]


def test_the_loop_saves_its_step_unless_a_peer_holds_it() -> None:
    saved: list[str] = []
    checkpoints = SimpleNamespace(
        just_in_time=SimpleNamespace(
            save=lambda reason, deadline: (
                saved.append(reason),
                SimpleNamespace(detail="written"),
            )[1]
        )
    )
    loop = SimpleNamespace(
        state_ready=True, checkpoints=checkpoints, state=SimpleNamespace(step=22)
    )
    elastic_group._hand_on(loop, 22, "a peer holds it")  # type: ignore[arg-type]
    elastic_group._hand_on(loop, 23, "a peer holds newer")  # type: ignore[arg-type]
    assert saved == []
    elastic_group._hand_on(loop, 21, "older elsewhere")  # type: ignore[arg-type]
    elastic_group._hand_on(loop, NO_STATE, "nowhere else")  # type: ignore[arg-type]
    assert saved == ["older elsewhere", "nowhere else"]


def test_a_loop_that_has_not_restored_its_state_saves_nothing() -> None:
    """Between ``Attempt.loop()`` and the loop's start the model holds the old attempt's values (or
    none): a save then would write a step the model does not hold."""
    saved: list[str] = []
    checkpoints = SimpleNamespace(
        just_in_time=SimpleNamespace(
            save=lambda reason, deadline: (
                saved.append(reason),
                SimpleNamespace(detail="written"),
            )[1]
        )
    )
    elastic_group._hand_on(
        SimpleNamespace(
            state_ready=False,
            checkpoints=checkpoints,  # type: ignore[arg-type]
            state=SimpleNamespace(step=0),
        ),
        NO_STATE,
        "stuck before the restore",
    )
    assert saved == []


def test_a_process_that_healed_or_is_healing_is_left_alone(kills: list[tuple[int, int]]) -> None:
    healer_in("healing", EPOCH)._fence_if_stuck(EPOCH, 4, waited_s=60.0, idle=False)
    later = Epoch(
        number=4, members=EPOCH.members, step=8, source=None, started_unix=2.0, reason="r"
    )
    healer_in("training", later)._fence_if_stuck(EPOCH, 4, waited_s=60.0, idle=False)
    assert kills == []


def _thread(work: str, stop: threading.Event) -> threading.Thread:
    """A stand-in training thread: ``blocked`` waits (as on a collective), ``busy`` computes."""

    def run() -> None:
        while not stop.is_set():
            if work == "blocked":
                stop.wait()
            else:
                sum(i * i for i in range(20_000))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_thread_cpu_clock_moves_only_while_it_computes() -> None:
    stop = threading.Event()
    blocked, busy = _thread("blocked", stop), _thread("busy", stop)
    try:
        time.sleep(0.05)
        assert blocked.native_id is not None and busy.native_id is not None
        before = thread_cpu_seconds(blocked.native_id), thread_cpu_seconds(busy.native_id)
        time.sleep(0.5)
        after = thread_cpu_seconds(blocked.native_id), thread_cpu_seconds(busy.native_id)
    finally:
        stop.set()
    assert None not in before + after
    assert after[0] == before[0], "a blocked thread uses no CPU"
    assert after[1] > before[1], "a computing thread does"  # type: ignore[operator]
    assert thread_cpu_seconds(2**31 - 1) is None  # no such thread


@pytest.mark.parametrize("work", ["blocked", "busy"])
def test_the_stop_watch_ends_a_blocked_thread_soon_and_a_computing_one_at_the_bound(
    work: str, kills: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(healer_module, "STUCK_IDLE_S", 0.6)
    monkeypatch.setattr(healer_module, "STOP_WATCH_INTERVAL_S", 0.05)
    healer = healer_in("training", EPOCH, ready_timeout_s=3.0)
    stop = threading.Event()
    thread = _thread(work, stop)
    healer._training_thread = thread.native_id
    started = time.monotonic()
    try:
        healer._watch_stop(EPOCH, 4)
    finally:
        stop.set()
    took = time.monotonic() - started
    assert kills == [(healer_module.os.getpid(), signal.SIGKILL)]
    if work == "blocked":
        assert took < 2.0, (
            f"a blocked thread is ended after its idle time, not the bound ({took:.2f} s)"
        )
    else:
        assert took >= 3.0, f"a computing thread gets the full bound ({took:.2f} s)"


def test_the_stop_watch_lets_go_once_the_thread_left_its_epoch(
    kills: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(healer_module, "STOP_WATCH_INTERVAL_S", 0.05)
    healer = healer_in("training", EPOCH)
    threading.Timer(0.2, lambda: setattr(healer, "_phase", "healing")).start()
    healer._watch_stop(EPOCH, 4)  # returns once the phase changed
    assert kills == []


def test_a_thread_blocked_building_an_abandoned_epoch_ends_the_process(
    kills: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round that opens while an epoch's group is being built abandons it; a thread that stays
    blocked in that build (gloo connecting to a peer that died, where no abort reaches) is ended
    like a stuck step (CI saw such a thread hold a node out of the job until the round's timeout)."""
    monkeypatch.setattr(healer_module, "STUCK_IDLE_S", 0.6)
    monkeypatch.setattr(healer_module, "STOP_WATCH_INTERVAL_S", 0.05)
    healer = healer_in("healing", EPOCH, ready_timeout_s=30.0)
    healer._forming = 4
    stop = threading.Event()
    thread = _thread("blocked", stop)
    healer._training_thread = thread.native_id
    started = time.monotonic()
    try:
        healer._watch_stop(None, 5, forming=4)
    finally:
        stop.set()
    assert kills == [(healer_module.os.getpid(), signal.SIGKILL)]
    assert time.monotonic() - started < 2.0


def test_the_forming_watch_lets_go_once_the_build_ended(
    kills: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(healer_module, "STOP_WATCH_INTERVAL_S", 0.05)
    healer = healer_in("healing", EPOCH)
    healer._forming = 4
    threading.Timer(0.2, lambda: setattr(healer, "_forming", None)).start()
    healer._watch_stop(None, 5, forming=4)  # returns once the build was given up
    healer._forming = 6  # a later epoch's build is no reason either
    healer._fence_if_stuck(None, 5, waited_s=60.0, idle=True, forming=4)
    assert kills == []


def test_a_round_that_abandons_a_build_starts_the_watch_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    healer = healer_in("healing", EPOCH)
    healer._forming, healer._abandoned, healer._stores = 4, False, []
    healer.member = EPOCH.members[0]
    announced: list[object] = []
    healer.membership.announce = lambda number, join: announced.append((number, join.ready))  # type: ignore[attr-defined]
    healer.group = SimpleNamespace(abort=lambda: None)  # type: ignore[assignment]
    watched: list[tuple[object, ...]] = []
    done = threading.Event()

    def watch(epoch: object, number: int, *, forming: int | None = None) -> None:
        watched.append((epoch, number, forming))
        done.set()

    monkeypatch.setattr(healer, "_watch_stop", watch)
    healer._round_opened(5, "node b lost")
    assert done.wait(5.0)
    assert healer._abandoned and announced == [(5, False)]
    assert watched == [(None, 5, 4)]
