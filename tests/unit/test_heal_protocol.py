"""The in-place membership protocol's decision (pure; no etcd)."""

from __future__ import annotations

import pytest

from elastic_trainer.heal.protocol import (
    NO_STATE,
    Epoch,
    Join,
    Member,
    Place,
    ProtocolError,
    RoundRules,
    decide,
    place_in,
)

RULES = RoundRules(min_world=1, max_world=4, settle_s=0.5, ready_timeout_s=10.0)


def member(node: str, local: int, pid: int) -> Member:
    return Member(id=f"{node}/{local}/{pid}", slot=f"{node}/{local}")


A0, A1, B0, B1 = member("a", 0, 10), member("a", 1, 11), member("b", 0, 20), member("b", 1, 21)
EPOCH = Epoch(
    number=3, members=(A0, A1, B0, B1), step=100, source=None, started_unix=1.0, reason="x"
)


def ready(m: Member, step: int = 120) -> Join:
    return Join(m, ready=True, step=step)


def test_records_round_trip() -> None:
    assert Epoch.decode(EPOCH.encode()) == EPOCH
    join = Join(A0, ready=False)
    assert Join.decode(join.encode()) == join and not join.has_state
    with pytest.raises(ProtocolError):
        Epoch.decode(b'{"number": 1}')
    with pytest.raises(ProtocolError):
        Join.decode(b"not json")


def test_closes_at_once_when_every_slot_answered_and_keeps_the_ranks() -> None:
    joins = [ready(B1), ready(A0), ready(B0), ready(A1)]
    decision = decide(EPOCH, joins, waited_s=0.0, rules=RULES, now_unix=5.0, reason="r")
    assert decision.epoch is not None
    assert decision.epoch.members == (A0, A1, B0, B1)
    assert (
        decision.epoch.number == 4 and decision.epoch.step == 120 and decision.epoch.source == A0.id
    )


def test_a_replacement_takes_the_dead_process_slot_and_rank() -> None:
    replacement = member("a", 1, 99)
    joins = [ready(A0), ready(replacement, NO_STATE), ready(B0), ready(B1)]
    decision = decide(EPOCH, joins, waited_s=0.0, rules=RULES, now_unix=5.0, reason="r")
    assert decision.epoch is not None
    assert decision.epoch.members == (A0, replacement, B0, B1)
    assert decision.epoch.source == A0.id  # the replacement holds nothing


def test_a_missing_member_is_waited_for_until_settled_then_left_out() -> None:
    joins = [ready(A0), ready(A1), ready(B0)]
    early = decide(EPOCH, joins, waited_s=0.1, rules=RULES, now_unix=5.0, reason="r")
    assert early.epoch is None and "to answer" in early.waiting_for
    late = decide(EPOCH, joins, waited_s=0.6, rules=RULES, now_unix=5.0, reason="r")
    assert late.epoch is not None and late.epoch.members == (A0, A1, B0)


def test_a_live_member_still_stopping_its_step_is_waited_for() -> None:
    joins = [ready(A0), ready(A1), ready(B0), Join(B1, ready=False)]
    decision = decide(EPOCH, joins, waited_s=5.0, rules=RULES, now_unix=5.0, reason="r")
    assert decision.epoch is None and "live member" in decision.waiting_for
    timed_out = decide(EPOCH, joins, waited_s=11.0, rules=RULES, now_unix=5.0, reason="r")
    assert timed_out.epoch is not None and B1 not in timed_out.epoch.members
    answered = decide(
        EPOCH, [*joins, ready(B1)], waited_s=5.0, rules=RULES, now_unix=5.0, reason="r"
    )
    assert answered.epoch is not None and answered.epoch.members == (A0, A1, B0, B1)


def test_the_newest_state_wins_whoever_holds_it() -> None:
    joins = [ready(A0, 119), ready(A1, 120), ready(B0, 119), ready(B1, 119)]
    decision = decide(EPOCH, joins, waited_s=0.0, rules=RULES, now_unix=5.0, reason="r")
    assert (
        decision.epoch is not None and decision.epoch.step == 120 and decision.epoch.source == A1.id
    )


def test_a_process_that_missed_the_epoch_never_hands_on_its_state() -> None:
    """Epoch 3 formed without c0 (late: its etcd was away) from the step-100 checkpoint; c0 still
    holds step 120 of the epoch before. Round 4 goes on from epoch 3's line, not c0's."""
    late = member("c", 0, 30)
    rules = RoundRules(min_world=1, max_world=5)
    joins = [ready(A0, 100), ready(A1, 100), ready(B0, 101), ready(B1, 101), ready(late, 120)]
    decision = decide(EPOCH, joins, waited_s=0.0, rules=rules, now_unix=5.0, reason="join")
    assert decision.epoch is not None and late in decision.epoch.members
    assert (decision.epoch.step, decision.epoch.source) == (101, B0.id)
    only_late = decide(EPOCH, [ready(late, 120), *(ready(m, NO_STATE) for m in (A0, A1, B0, B1))], waited_s=0.0,
                       rules=rules, now_unix=5.0, reason="join")  # fmt: skip
    assert only_late.epoch is not None and (only_late.epoch.step, only_late.epoch.source) == (
        NO_STATE,
        None,
    )


def test_nobody_holding_state_means_the_checkpoint() -> None:
    joins = [ready(m, NO_STATE) for m in (A0, A1, B0, B1)]
    decision = decide(EPOCH, joins, waited_s=0.0, rules=RULES, now_unix=5.0, reason="r")
    assert (
        decision.epoch is not None
        and decision.epoch.source is None
        and decision.epoch.step == NO_STATE
    )


def test_newcomers_follow_in_arrival_order_and_extra_ones_stay_spares() -> None:
    rules = RoundRules(min_world=1, max_world=5)
    c0, d0 = member("c", 0, 30), member("d", 0, 40)
    joins = [ready(A0), ready(A1), ready(B0), ready(B1), ready(d0, NO_STATE), ready(c0, NO_STATE)]
    decision = decide(
        EPOCH,
        joins,
        waited_s=0.0,
        rules=rules,
        now_unix=5.0,
        reason="join",
        arrival={d0.id: 7, c0.id: 9},
    )
    assert decision.epoch is not None and decision.epoch.members == (A0, A1, B0, B1, d0)
    assert decision.spares == (c0,)


def test_below_the_minimum_the_round_waits() -> None:
    rules = RoundRules(min_world=4, max_world=4, settle_s=0.5)
    decision = decide(
        EPOCH,
        [ready(A0), ready(A1), ready(B0)],
        waited_s=3.0,
        rules=rules,
        now_unix=5.0,
        reason="r",
    )
    assert decision.epoch is None and "at least 4" in decision.waiting_for


def test_rules_are_checked() -> None:
    with pytest.raises(ValueError):
        RoundRules(min_world=3, max_world=2)
    with pytest.raises(ValueError):
        RoundRules(min_world=1, max_world=2, settle_s=5.0, ready_timeout_s=1.0)


def test_a_stuck_process_whose_replacement_answered_is_not_waited_for() -> None:
    """B1 said it lives, then was stuck and ended itself; its launcher's replacement answers for
    the same slot: the round closes at once, with the replacement in B1's rank."""
    replacement = Member(id="b/1/999", slot=B1.slot)
    joins = [
        ready(A0),
        ready(A1),
        ready(B0),
        Join(B1, ready=False),
        ready(replacement, step=NO_STATE),
    ]
    decision = decide(EPOCH, joins, waited_s=0.0, rules=RULES, now_unix=5.0, reason="r")
    assert decision.epoch is not None
    assert decision.epoch.members == (A0, A1, B0, replacement)


def test_a_slot_s_newest_process_replaces_an_older_one_that_answered_with_state() -> None:
    """A1 answered ready with step 120, then its launcher restarted the whole group (ending A1)
    and A1's replacement answered for the same slot: A1 is dead, so the slot is the replacement's
    and A1 is never the source, however new its state."""
    replacement = member("a", 1, 99)
    joins = [ready(A1, 121), ready(A0), ready(B0), ready(B1), ready(replacement, NO_STATE)]
    arrival = {A1.id: 1, A0.id: 2, B0.id: 3, B1.id: 4, replacement.id: 5}
    decision = decide(
        EPOCH, joins, waited_s=0.0, rules=RULES, now_unix=5.0, reason="r", arrival=arrival
    )
    assert decision.epoch is not None
    assert decision.epoch.members == (A0, replacement, B0, B1)
    assert (decision.epoch.step, decision.epoch.source) == (120, A0.id)


def test_a_process_outside_a_full_epoch_is_a_spare_whatever_it_holds() -> None:
    """Only a member, a replacement (its slot is listed) or a newcomer with room opens a round."""
    c0, a0_replacement = member("c", 0, 30), member("a", 0, 99)
    assert place_in(EPOCH, B1, max_world=4) is Place.MEMBER
    assert place_in(EPOCH, a0_replacement, max_world=4) is Place.REPLACED
    assert place_in(EPOCH, c0, max_world=4) is Place.SPARE
    assert place_in(EPOCH, c0, max_world=5) is Place.OUTSIDE
