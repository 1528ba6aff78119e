"""The in-place membership on a real etcd: epochs, rounds, the responder, one winner per round."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from elastic_trainer.heal.membership import HealTimeoutError, Membership
from elastic_trainer.heal.protocol import NO_STATE, Join, Member, RoundRules
from rendezvous.etcd_client import EtcdConnection

pytestmark = pytest.mark.timeout(120)


def _members(n: int) -> list[Member]:
    return [Member(id=f"n{i}/0/{1000 + i}", slot=f"n{i}/0") for i in range(n)]


def test_a_round_forms_the_next_epoch_once_and_every_member_sees_it(
    connection: EtcdConnection,
) -> None:
    run_id = f"membership-{uuid.uuid4().hex[:8]}"
    rules = RoundRules(min_world=1, max_world=3, settle_s=0.3)
    members = _members(3)
    opened: list[tuple[str, int, str]] = []
    views = [
        Membership(
            connection,
            run_id,
            m,
            rules,
            on_round_open=lambda n, why, who=m.id: opened.append((who, n, why)),
        )
        for m in members
    ]
    try:
        for view in views:
            view.start()
        first = views[0].form(members, step=NO_STATE, reason="rendezvous")
        assert first.number == 1
        assert all(v.wait(lambda v=v: v.epoch == first, 10.0) for v in views)

        # Member 2 is gone; 0 opens round 2, 0 and 1 answer with their steps; both try to close it.
        views[0].open_round(2, "peer lost")
        assert views[1].wait(lambda: views[1].round_open(2), 10.0)
        views[0].answer(2, Join(members[0], ready=True, step=41))
        views[1].answer(2, Join(members[1], ready=True, step=42))
        results: list[object] = []
        threads = [
            threading.Thread(
                target=lambda v=v: results.append(
                    v.settle(2, deadline=time.monotonic() + 20, reason="peer lost")
                )
            )
            for v in views[:2]
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(results) == 2 and results[0] == results[1]  # one epoch, whoever wrote it
        second = views[0].epoch
        assert second is not None and second.number == 2
        assert second.members == (members[0], members[1])  # 2 did not answer within settle_s
        assert second.step == 42 and second.source == members[1].id
        assert {n for _, n, _ in opened} == {2} and {who for who, _, _ in opened} == {
            m.id for m in members
        }
        assert views[2].wait(lambda: views[2].epoch == second, 10.0)  # the absent one sees it too

        views[0].finish()
        assert views[1].wait(lambda: (e := views[1].epoch) is not None and e.finished, 10.0)
    finally:
        for view in views:
            view.close()


def test_a_round_without_enough_members_times_out(connection: EtcdConnection) -> None:
    run_id = f"membership-{uuid.uuid4().hex[:8]}"
    members = _members(2)
    view = Membership(
        connection, run_id, members[0], RoundRules(min_world=2, max_world=2, settle_s=0.1)
    )
    try:
        view.start()
        view.form(members, step=NO_STATE, reason="rendezvous")
        view.open_round(2, "peer lost")
        view.answer(2, Join(members[0], ready=True, step=5))
        with pytest.raises(HealTimeoutError, match="at least 2 members"):
            view.settle(2, deadline=time.monotonic() + 1.5, reason="peer lost")
    finally:
        view.close()


def _staying_and_leaving(
    connection: EtcdConnection, members: list[Member]
) -> tuple[Membership, Membership]:
    """Two members' views of a new run whose rounds settle in 0.2 s and wait a minute for a
    live member to become ready."""
    run_id = f"membership-{uuid.uuid4().hex[:8]}"
    rules = RoundRules(min_world=1, max_world=2, settle_s=0.2, ready_timeout_s=60.0)
    return Membership(connection, run_id, members[0], rules), Membership(
        connection, run_id, members[1], rules
    )


def test_a_member_that_leaves_after_a_provisional_answer_is_not_waited_for(
    connection: EtcdConnection,
) -> None:
    """A node leaving (SIGTERM) while a round opens: its workers answered that they live, then
    stopped for good. Their withdrawn answer makes them missing (waited ``settle_s``), not live
    members to wait ``ready_timeout_s`` for (a minute: a scale-down once took 60.7 s in CI)."""
    members = _members(2)
    stays, leaves = _staying_and_leaving(connection, members)
    try:
        stays.start()
        leaves.start()
        first = stays.form(members, step=NO_STATE, reason="rendezvous")
        assert leaves.wait(lambda: leaves.epoch == first, 10.0)
        stays.open_round(2, "node lost")
        assert leaves.wait(lambda: leaves.round_open(2), 10.0)
        leaves.announce(2, Join(members[1], ready=False))
        stays.answer(2, Join(members[0], ready=True, step=7))
        with pytest.raises(HealTimeoutError, match="1 live member"):
            stays.settle(2, deadline=time.monotonic() + 1.0, reason="node lost")

        assert leaves.withdraw(after=1) == first  # read from etcd, not from its watch
        leaves.announce(2, Join(members[1], ready=False))  # a responder that saw the round late
        leaves.answer(2, Join(members[1], ready=True, step=7))  # or a training thread
        started = time.monotonic()
        second = stays.settle(2, deadline=started + 30, reason="node lost")
        assert second.members == (members[0],) and second.step == 7
        assert time.monotonic() - started < 10  # the round's ready_timeout_s is 60 s
        assert leaves.withdraw(after=1) == second  # nothing left to take back
    finally:
        stays.close()
        leaves.close()


def test_an_answer_written_just_before_the_withdraw_is_taken_back_too(
    connection: EtcdConnection,
) -> None:
    """The withdraw reads the answers from etcd: one whose watch event has not come back yet
    (written by another client here, as the responder thread's write can be) goes too."""
    members = _members(2)
    stays, leaves = _staying_and_leaving(connection, members)
    try:
        stays.start()
        first = stays.form(members, step=NO_STATE, reason="rendezvous")
        stays.open_round(2, "node lost")
        stays.answer(2, Join(members[0], ready=True, step=3))
        leaves.announce(2, Join(members[1], ready=False))  # never started: no watch of its own
        leaves.withdraw(after=first.number)
        second = stays.settle(2, deadline=time.monotonic() + 10, reason="node lost")
        assert second.members == (members[0],)
    finally:
        stays.close()
        leaves.close()
