"""Retry policy of EtcdConnection, with a fake client and an injected sleep (nothing waits)."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from rendezvous import etcd_client
from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def failing_then_ok(failures: list[BaseException]) -> Any:
    """An operation that raises each of ``failures`` in turn, then returns ``"ok"``."""

    def operation(_client: object) -> str:
        if failures:
            raise failures.pop(0)
        return "ok"

    return operation


@pytest.fixture
def connection(monkeypatch: pytest.MonkeyPatch) -> tuple[EtcdConnection, list[float], list[str]]:
    sleeps: list[float] = []
    monkeypatch.setattr(etcd_client, "_OUTAGES", etcd_client._Outages())  # this test's alone
    config = EtcdClientConfig(endpoints=parse_endpoints("a:1,b:2,c:3"), retry_timeout=1000)
    conn = EtcdConnection(
        config, sleep=sleeps.append, route_to_leader=False
    )  # the home member's failover
    connected: list[str] = []

    def fake_connect(endpoint: Any) -> object:
        connected.append(str(endpoint))
        return object()

    monkeypatch.setattr(conn, "_connect", fake_connect)
    return conn, sleeps, connected


def test_transient_errors_are_retried_on_the_next_endpoint(connection, caplog) -> None:  # type: ignore[no-untyped-def]
    conn, sleeps, connected = connection
    failures = [
        conn.etcd3.exceptions.ConnectionFailedError(),
        FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED),
    ]

    with caplog.at_level(logging.DEBUG, logger="rendezvous.etcd_client"):
        assert conn.call(failing_then_ok(failures), what="a test op") == "ok"
    assert connected == ["a:1", "b:2", "c:3"]
    assert len(sleeps) == 2 and all(0 < s <= 1.2 for s in sleeps)
    retries = [r for r in caplog.records if "; retry " in r.getMessage()]
    assert len(retries) == 2  # each retry logged once, with its cause, at DEBUG
    assert "ConnectionFailedError" in retries[0].getMessage()
    assert {r.levelno for r in retries} == {logging.DEBUG}
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 2, said  # the outage: one line when it begins, one when it ends
    assert said[0].startswith("etcd at a:1,b:2,c:3 does not answer (a test op: ")
    assert said[1].startswith("etcd at a:1,b:2,c:3 answers again (after ")


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
    ],
)
def test_permanent_errors_fail_fast(connection, code: grpc.StatusCode) -> None:  # type: ignore[no-untyped-def]
    conn, sleeps, _ = connection
    calls = []

    def operation(_client: object) -> None:
        calls.append(1)
        raise FakeRpcError(code, "etcdserver: permission denied")

    with pytest.raises(RendezvousConnectionError, match=f"refused a test op: {code.name}"):
        conn.call(operation, what="a test op")
    assert calls == [1] and sleeps == []


def test_expired_auth_token_reconnects(connection) -> None:  # type: ignore[no-untyped-def]
    conn, _, connected = connection
    failures = [FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token")]

    assert conn.call(failing_then_ok(failures), what="op") == "ok"
    assert len(connected) == 2


def test_retries_stop_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    conn = EtcdConnection(
        EtcdClientConfig(endpoints=parse_endpoints("a:1"), retry_timeout=5),
        sleep=lambda s: clock.__setitem__(0, clock[0] + s),
        route_to_leader=False,
    )
    monkeypatch.setattr(conn, "_connect", lambda endpoint: object())
    attempts = []

    def operation(_client: object) -> None:
        attempts.append(clock[0])
        raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")

    with pytest.raises(RendezvousConnectionError, match="did not answer op within 5s"):
        conn.call(operation, what="op")
    assert 3 < len(attempts) < 20 and attempts[-1] <= 6.1


def test_retries_leave_the_global_random_generator_alone(connection) -> None:  # type: ignore[no-untyped-def]
    """A worker restores Python's global random state bit for bit after a fault; an etcd retry
    on a background thread must not draw from it (its jitter has a generator of its own)."""
    import random

    conn, sleeps, _ = connection
    failures = [conn.etcd3.exceptions.ConnectionFailedError() for _ in range(3)]

    before = random.getstate()
    assert conn.call(failing_then_ok(failures), what="a test op") == "ok"
    assert len(sleeps) == 3
    assert random.getstate() == before


def test_too_many_requests_is_back_pressure_and_retried(connection) -> None:  # type: ignore[no-untyped-def]
    """etcd refuses requests while its apply lags its commits by 5,000 entries: a retry after a
    backoff succeeds, failing the rendezvous would not help."""
    conn, sleeps, _ = connection
    failures = [FakeRpcError(grpc.StatusCode.UNKNOWN, "etcdserver: too many requests")]

    assert conn.call(failing_then_ok(failures), what="a test op") == "ok"
    assert len(sleeps) == 1


def test_an_attempt_that_never_connected_is_not_counted_as_an_etcd_request(connection) -> None:  # type: ignore[no-untyped-def]
    from rendezvous.etcd_client import NOT_SENT

    conn, _, _ = connection
    failures = [
        FakeRpcError(
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: "
            "UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused",
        ),
        FakeRpcError(
            grpc.StatusCode.UNAVAILABLE, "Stream removed (recvmsg:Connection reset by peer)"
        ),
    ]

    assert conn.call(failing_then_ok(failures), what="a test op") == "ok"
    assert conn.requests == 2  # the reset one reached a member, the refused one did not
    assert conn.request_counts["a test op"] == 2 and conn.request_counts[NOT_SENT] == 1
