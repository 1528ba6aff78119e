"""A replacement process that finds its slot still held by the process it replaces, on a real etcd.

The race this covers (seen in CI): a survivor answered round 2 with its state, then its launcher
restarted the whole group (a user error), ending it. The round closed as soon as the other slot's
replacement answered, so epoch 2 names the dead survivor. Its own slot's replacement answers
afterwards: it must open round 3, not wait as a spare for a place that never frees up while
epoch 2's other member waits for a dead peer.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from elastic_trainer.heal.healer import Healer, RunFinished, heal_rendezvous
from elastic_trainer.heal.membership import HealKeys, Membership
from elastic_trainer.heal.protocol import NO_STATE, Epoch, Join, Member, RoundRules
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.settings import HealSettings
from rendezvous import etcd_ops

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def replacement(etcd_server) -> Iterator[Healer]:
    settings = HealSettings(
        enabled=True,
        join=True,
        endpoint=etcd_server.endpoint,
        rdzv_conf="retry_timeout=2",
        timeout_s=30.0,
    )
    made = Healer(
        settings,
        heal_rendezvous(settings, f"replace-{uuid.uuid4().hex[:8]}"),
        node="a",
        local_rank=1,
        backend="gloo",
        device=torch.device("cpu"),
        pg_timeout_s=60,
        world=(2, 2),
    )
    try:
        yield made
    finally:
        made.close()


def test_a_replacement_whose_slot_an_epoch_gave_its_dead_predecessor_opens_the_next_round(
    replacement: Healer,
) -> None:
    peer, predecessor = (
        Member(id="a/0/100-aaaaaa", slot="a/0"),
        Member(id="a/1/101-bbbbbb", slot="a/1"),
    )
    assert predecessor.slot == replacement.member.slot
    keys = HealKeys.of(replacement.run_id)
    conn = replacement.connection
    survivor = Membership(
        conn, replacement.run_id, predecessor, RoundRules(min_world=2, max_world=2)
    )
    survivor.start()
    outcome: list[BaseException | None] = []
    thread = threading.Thread(target=lambda: outcome.append(_start(replacement)), daemon=True)
    try:
        first = survivor.form([peer, predecessor], step=NO_STATE, reason="rendezvous")
        survivor.open_round(2, "a peer failed")
        survivor.answer(2, Join(predecessor, ready=True, step=2))
        thread.start()
        deadline = time.monotonic() + 15
        while not etcd_ops.get_range(
            conn, keys.join(2, replacement.member.id), what="a test read"
        ).kvs:
            assert time.monotonic() < deadline, "the replacement never answered round 2"
            time.sleep(0.05)
        # The epoch that closed (as another process saw round 2) before this answer arrived.
        second = Epoch(
            number=2,
            members=(peer, predecessor),
            step=2,
            source=predecessor.id,
            started_unix=first.started_unix,
            reason="a peer failed",
        )
        etcd_ops.put_key(conn, keys.epoch, second.encode(), what="writing the test's epoch")
        opened = survivor.wait(lambda: survivor.round_open(3), 15.0)
        assert opened, "the replacement waited as a spare instead of opening round 3"
    finally:
        # Close round 3 as a finished run, so that the replacement's round returns (nobody else answers it).
        done = Epoch(
            number=3,
            members=(peer,),
            step=NO_STATE,
            source=None,
            started_unix=time.time(),
            reason="finished",
            finished=True,
        )
        etcd_ops.put_key(conn, keys.epoch, done.encode(), what="finishing the test's run")
        if thread.ident is not None:
            thread.join(30)
        survivor.close()
    assert len(outcome) == 1 and isinstance(outcome[0], RunFinished), outcome


def _start(healer: Healer) -> BaseException | None:
    env = DistEnv(
        rank=1,
        local_rank=1,
        world_size=2,
        local_world_size=2,
        restart_count=1,
        launched=True,
        device=torch.device("cpu"),
        backend="gloo",
    )
    try:
        healer.start(env)
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        return exc
    return None
