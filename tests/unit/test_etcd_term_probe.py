"""A write in flight across a raft term change is ended early (``etcd_ops._await_write``); fakes
for the gRPC future and the member. The real thing: ``tests/integration/test_etcd_faults.py``
(a frozen leader on a real 3-member cluster)."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from rendezvous import etcd_ops
from rendezvous.etcd_client import (
    EtcdClientConfig,
    EtcdConnection,
    LeaderLostError,
    parse_endpoints,
)


class FakeFuture:
    """Unanswered for ``waits`` calls of ``result``, then ``outcome`` (a response or an error)."""

    def __init__(self, waits: int, outcome: Any) -> None:
        self.waits, self.outcome, self.cancelled = waits, outcome, False

    def result(self, timeout: float) -> Any:
        if self.waits > 0:
            self.waits -= 1
            raise grpc.FutureTimeoutError()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def _response(term: int) -> Any:
    return types.SimpleNamespace(header=types.SimpleNamespace(raft_term=term))


class Member:
    """A client whose member answers probes with ``terms`` in turn (an exception: it fails)."""

    def __init__(self, terms: list[Any]) -> None:
        self.terms = terms
        self.probes: list[Any] = []
        self.client = types.SimpleNamespace(call_credentials=None, metadata=None,
                                            kvstub=types.SimpleNamespace(Range=self._range))

    def _range(self, request: Any, timeout: float, **_: Any) -> Any:
        self.probes.append(request)
        term = self.terms.pop(0)
        if isinstance(term, BaseException):
            raise term
        return _response(term)


@pytest.fixture
def connection() -> Iterator[EtcdConnection]:
    made = EtcdConnection(EtcdClientConfig(endpoints=parse_endpoints("127.0.0.1:1")))  # never connects
    try:
        yield made
    finally:
        made.close()


def _write(connection: EtcdConnection, member: Member, future: FakeFuture) -> Any:
    method = types.SimpleNamespace(future=lambda request, timeout, **_: future)
    return etcd_ops._await_write(connection, member.client, method, object(), 5.0, probe_key=b"/k", interval=0.0)


def test_a_write_answered_in_time_sends_no_probe_and_records_the_term(connection: EtcdConnection) -> None:
    member = Member([])
    assert _write(connection, member, FakeFuture(0, _response(7))).header.raft_term == 7
    assert member.probes == [] and connection.raft_term.highest == 7


def test_a_slow_write_under_the_same_term_is_waited_for(connection: EtcdConnection) -> None:
    connection.raft_term.observe(4)
    member = Member([4, 4, RuntimeError("probe lost"), 4])
    future = FakeFuture(4, _response(4))
    assert _write(connection, member, future).header.raft_term == 4
    assert not future.cancelled and len(member.probes) == 4
    probe = member.probes[0]
    assert probe.serializable and probe.count_only and probe.key == b"/k"  # local, cheap, a key the write touches
    assert connection.request_counts[etcd_ops.TERM_PROBE_KIND] == 4


def test_a_write_across_a_term_change_is_cancelled_as_lost(connection: EtcdConnection) -> None:
    connection.raft_term.observe(4)
    member = Member([4, 5])
    future = FakeFuture(10, _response(5))
    with pytest.raises(LeaderLostError, match="from 4 to 5"):
        _write(connection, member, future)
    assert future.cancelled and len(member.probes) == 2
    assert connection.is_transient(LeaderLostError("x")), "retried, on the next member"


def test_without_a_term_seen_before_the_first_probe_is_the_baseline(connection: EtcdConnection) -> None:
    member = Member([9, 9, 10])
    future = FakeFuture(10, _response(10))
    with pytest.raises(LeaderLostError, match="from 9 to 10"):
        _write(connection, member, future)
    assert len(member.probes) == 3


def test_the_write_s_own_failure_is_raised_unchanged(connection: EtcdConnection) -> None:
    connection.raft_term.observe(4)
    failure = RuntimeError("DEADLINE_EXCEEDED")
    with pytest.raises(RuntimeError, match="DEADLINE_EXCEEDED"):
        _write(connection, Member([4]), FakeFuture(1, failure))


def test_the_probe_reads_a_key_the_write_touches(connection: EtcdConnection) -> None:
    rpc = connection.etcd3.etcdrpc
    cas = rpc.TxnRequest(compare=[etcd_ops.mod_is(connection, "/a", 3)], success=[etcd_ops.put(connection, "/b", b"")])
    blind = rpc.TxnRequest(success=[etcd_ops.put(connection, "/b", b"")])
    assert etcd_ops._written_key(cas) == b"/a" and etcd_ops._written_key(blind) == b"/b"
    assert etcd_ops._written_key(rpc.PutRequest(key=b"/c")) == b"/c"


def test_a_lost_leader_does_not_double_the_next_deadline() -> None:
    """An attempt ended by the term probe was cut short on purpose: the next member gets the
    same deadline, not twice it."""
    now = [0.0]
    client = types.SimpleNamespace(timeout=10.0)
    patience = etcd_ops._Patience(2.5, clock=lambda: now[0])
    given: list[float] = []

    def lost(timeout: float) -> Any:
        given.append(timeout)
        now[0] += timeout  # as long as its whole deadline: still not a timeout
        raise LeaderLostError("moved")

    for _ in range(2):
        with pytest.raises(LeaderLostError):
            patience.send(client, lost)
    assert given == [2.5, 2.5]
