"""The checkpoint fence of a worker that heals in place, on a real etcd: a member of the current
epoch commits; one the job went on without, or one that cannot reach etcd, does not."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from elastic_trainer.heal.healer import FENCE_TIMEOUT_S, Healer, heal_rendezvous
from elastic_trainer.heal.membership import HealKeys
from elastic_trainer.heal.protocol import NO_STATE, Epoch, Member
from elastic_trainer.runtime.settings import HealSettings
from rendezvous import etcd_ops
from rendezvous.etcd_server import free_port

pytestmark = pytest.mark.timeout(120)


def _healer(endpoint: str, run_id: str) -> Healer:
    settings = HealSettings(enabled=True, endpoint=endpoint, rdzv_conf="retry_timeout=2")
    return Healer(
        settings,
        heal_rendezvous(settings, run_id),
        node="a",
        local_rank=0,
        backend="gloo",
        device=torch.device("cpu"),
        pg_timeout_s=60,
        world=(1, 2),
    )


@pytest.fixture
def healer(etcd_server) -> Iterator[Healer]:
    made = _healer(etcd_server.endpoint, f"fence-{uuid.uuid4().hex[:8]}")
    try:
        yield made
    finally:
        made.close()


def _write_epoch(healer: Healer, number: int, members: tuple[Member, ...]) -> None:
    epoch = Epoch(
        number=number,
        members=members,
        step=NO_STATE,
        source=None,
        started_unix=time.time(),
        reason="test",
    )
    etcd_ops.put_key(
        healer.connection,
        HealKeys.of(healer.run_id).epoch,
        epoch.encode(),
        what="writing a test epoch",
    )


def test_a_member_of_the_current_epoch_may_commit(healer: Healer) -> None:
    other = Member(id="b/0/2", slot="b/0")
    assert healer.commit_fence() == "the job's membership record is gone"
    _write_epoch(healer, 1, (healer.member, other))
    assert healer.commit_fence() is None
    _write_epoch(healer, 2, (other,))  # the others went on without this process (it was cut off)
    assert healer.commit_fence() == "the job went on without this process (epoch 2)"
    _write_epoch(healer, 3, (other, healer.member))  # it joined again
    assert healer.commit_fence() is None


def test_a_process_that_cannot_reach_etcd_may_not_commit() -> None:
    cut_off = _healer(
        f"127.0.0.1:{free_port()}", f"fence-{uuid.uuid4().hex[:8]}"
    )  # nothing listens there
    try:
        started = time.monotonic()
        refused = cut_off.commit_fence()
        took = time.monotonic() - started
    finally:
        cut_off.connection.close()
    assert refused is not None and refused.startswith(
        f"etcd did not confirm within {FENCE_TIMEOUT_S:g} s that this process still belongs to the job"
    )
    assert took < FENCE_TIMEOUT_S + 10, "bounded"
