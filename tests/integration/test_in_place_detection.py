"""How a launcher that heals in place notices a lost node, on a real etcd: peer heartbeats before
the liveness lease, the lease without them, and no heal once the job finished. Each handler uses
its rendezvous handler's etcd connection, as the launcher does (one keep-alive and one watch
stream per launcher)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_trainer.heal.membership import HealKeys
from elastic_trainer.heal.protocol import NO_STATE, Epoch, Member
from elastic_trainer.launch.in_place import (
    InPlaceRendezvousHandler,
    etcd_connection_for,
    node_key,
)
from elastic_trainer.ops.processes import wait_for
from rendezvous import etcd_ops
from rendezvous.etcd_client import EtcdConnection
from rendezvous.plugin import create_rdzv_handler

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def launchers(etcd_server) -> Iterator[Callable[..., InPlaceRendezvousHandler]]:
    """Start one node's in-place handler (the real ``etcd-v3`` one inside); all shut down at exit."""
    made: list[tuple[InPlaceRendezvousHandler, EtcdConnection]] = []

    def start(run_id: str, node: str, *, heartbeats: bool = True) -> InPlaceRendezvousHandler:
        params = RendezvousParameters("etcd-v3", etcd_server.endpoint, run_id, 1, 3)
        inner = create_rdzv_handler(params)
        conn = etcd_connection_for(inner)  # what register_backend's factory does
        handler = InPlaceRendezvousHandler(
            inner,
            conn,
            run_id=run_id,
            node=node,
            heartbeat_host="127.0.0.1" if heartbeats else None,
        )
        made.append((handler, conn))
        return handler

    try:
        yield start
    finally:
        for handler, conn in made:
            handler.shutdown()  # the inner handler owns the connection and closes it
            conn.close()  # idempotent


def _stream_threads() -> dict[str, int]:
    names = [t.name for t in threading.enumerate()]
    return {kind: names.count(kind) for kind in ("etcd-v3-keepalive", "etcd-v3-watch")}


def test_the_in_place_handler_shares_the_rendezvous_connection(launchers) -> None:
    """One keep-alive stream and one watch stream per launcher: the liveness lease and the node
    and epoch watches ride on the rendezvous handler's streams, and leave with it."""
    before = _stream_threads()
    handler = launchers(f"shared-{uuid.uuid4().hex[:8]}", "a")
    assert handler._connection is handler._inner.connection  # type: ignore[attr-defined]
    after = _stream_threads()
    assert {kind: after[kind] - before[kind] for kind in after} == {
        "etcd-v3-keepalive": 1,
        "etcd-v3-watch": 1,
    }
    handler.shutdown()
    wait_for(lambda: _stream_threads() == before, timeout=10.0, what="the streams ended")


def _write_epoch(
    connection: EtcdConnection, run_id: str, nodes: list[str], *, finished: bool = False
) -> None:
    members = tuple(Member(id=f"{n}/0/{1000 + i}", slot=f"{n}/0") for i, n in enumerate(nodes))
    epoch = Epoch(
        number=1,
        members=members,
        step=NO_STATE,
        source=None,
        started_unix=time.time(),
        reason="rendezvous",
        finished=finished,
    )
    etcd_ops.put_key(
        connection, HealKeys.of(run_id).epoch, epoch.encode(), what="writing a test epoch"
    )


def _exists(connection: EtcdConnection, key: str) -> bool:
    return bool(etcd_ops.get_range(connection, key, what="reading a test key").kvs)


def test_a_silent_node_is_reported_by_heartbeats_while_its_lease_still_lives(
    connection: EtcdConnection, launchers, caplog: pytest.LogCaptureFixture
) -> None:
    run_id = f"beats-{uuid.uuid4().hex[:8]}"
    keys = HealKeys.of(run_id)
    a, b = launchers(run_id, "a"), launchers(run_id, "b")
    _write_epoch(connection, run_id, ["a", "b"])
    assert a._heartbeats is not None and b._heartbeats is not None
    wait_for(
        lambda: "b" in a._heartbeats.heard() and "a" in b._heartbeats.heard(),
        timeout=10.0,
        what="each launcher hears the other (addresses from the nodes' etcd keys)",
    )
    time.sleep(1.5)
    assert not _exists(connection, keys.open(2)), "two live nodes: no round"

    caplog.set_level(logging.WARNING, logger="elastic_trainer.launch.in_place")
    b._heartbeats.close()  # node b's network goes silent; its etcd lease is still renewed
    wait_for(lambda: _exists(connection, keys.open(2)), timeout=10.0, what="a opened a heal round")
    assert _exists(connection, node_key(keys, "b")), (
        "b's lease had not expired: the heartbeats found it"
    )
    opened = etcd_ops.get_range(connection, keys.open(2), what="reading the round").kvs[0].value
    assert b"node b lost" in bytes(opened)
    assert "node b is gone (no heartbeat for 0.8 s)" in caplog.text


def test_without_heartbeats_the_lease_finds_the_lost_node(
    connection: EtcdConnection, launchers
) -> None:
    run_id = f"lease-{uuid.uuid4().hex[:8]}"
    keys = HealKeys.of(run_id)
    a = launchers(run_id, "a", heartbeats=False)
    b = launchers(run_id, "b", heartbeats=False)
    _write_epoch(connection, run_id, ["a", "b"])
    time.sleep(1.0)
    assert not _exists(connection, keys.open(2))
    connection.call(lambda client: client.revoke_lease(b._lease_id), what="a lease revoke")
    wait_for(lambda: _exists(connection, keys.open(2)), timeout=10.0, what="a opened a heal round")
    opened = etcd_ops.get_range(connection, keys.open(2), what="reading the round").kvs[0].value
    assert b"node b lost" in bytes(opened) and a._heartbeats is None


def test_a_finished_job_opens_no_round_for_a_lost_node(
    connection: EtcdConnection, launchers
) -> None:
    run_id = f"finished-{uuid.uuid4().hex[:8]}"
    keys = HealKeys.of(run_id)
    a = launchers(run_id, "a")
    _write_epoch(connection, run_id, ["a", "b"], finished=True)
    wait_for(lambda: a._finished, timeout=10.0, what="the launcher saw the job finish")
    b = launchers(run_id, "b")
    connection.call(lambda client: client.revoke_lease(b._lease_id), what="a lease revoke")
    time.sleep(1.0)
    assert not _exists(connection, keys.open(2)), "no heal round for a job that finished"
