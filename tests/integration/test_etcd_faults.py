"""Faults around etcd: restarts, unreachable endpoints, bad TLS files, wrong credentials,
lost responses. Every failure must be a clear error within a bound, never a hang."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from rendezvous import EtcdV3Store, create_handler
from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints
from rendezvous.etcd_server import find_etcd_binary, free_port, local_cluster
from tests.support.etcd_members import leader_first

pytestmark = pytest.mark.integration


def params(
    endpoint: str, run_id: str, min_nodes: int = 1, max_nodes: int = 2, **conf: Any
) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, min_nodes, max_nodes, **conf)


@contextlib.contextmanager
def handler_connection(endpoint: str, run_id: str, **conf: Any) -> Iterator[EtcdConnection]:
    """The connection of the handler of ``params`` (connected, not joined); the handler leaves
    (and closes it) at exit."""
    handler = create_handler(params(endpoint, run_id, **conf))
    try:
        yield handler.connection
    finally:
        handler.leave()


def test_unreachable_endpoint_fails_within_retry_timeout(unique_id: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"etcd at {dead} did not answer"):
        create_handler(params(dead, unique_id, retry_timeout=2, read_timeout=1))
    assert time.monotonic() - started < 8


def test_failover_to_the_next_endpoint(etcd_server, unique_id: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    endpoints = f"{dead},{etcd_server.endpoint}"
    with handler_connection(endpoints, unique_id, retry_timeout=10, read_timeout=2) as connection:
        store = EtcdV3Store(connection, f"/test/{unique_id}/store")
        store.set("k", b"via-second-member")
        assert store.get("k") == b"via-second-member"
        assert connection.endpoint == parse_endpoints(etcd_server.endpoint)[0]


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        (
            {"protocol": "https", "ca_cert": "/nonexistent/ca.pem"},
            "ca_cert: cannot read /nonexistent/ca.pem",
        ),
        ({"protocol": "https", "ca_cert": "GARBAGE"}, "ca_cert: .* is not a PEM file"),
        ({"ca_cert": "PEM"}, "protocol: TLS files were given"),
        (
            {"protocol": "https", "ssl_cert": "PEM"},
            "ssl_cert and ssl_cert_key must be given together",
        ),
        ({"protocol": "gopher"}, "protocol: must be 'http' or 'https'"),
    ],
)
def test_bad_tls_settings_are_rejected_before_connecting(
    tmp_path: Path, unique_id: str, conf: dict[str, str], message: str
) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    pem = tmp_path / "ca.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    conf = {k: {"GARBAGE": str(garbage), "PEM": str(pem)}.get(v, v) for k, v in conf.items()}
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        create_handler(params(f"127.0.0.1:{free_port()}", unique_id, **conf))
    assert time.monotonic() - started < 1


@pytest.fixture
def etcd_with_auth(own_etcd_server, tmp_path: Path):  # type: ignore[no-untyped-def]
    etcdctl = str(Path(find_etcd_binary()).with_name("etcdctl"))
    base = [etcdctl, f"--endpoints={own_etcd_server.endpoint}"]
    for args in (["user", "add", "root:s3cret"], ["auth", "enable"]):
        subprocess.run(base + args, check=True, capture_output=True, timeout=30)
    return own_etcd_server


def test_wrong_password_fails_fast(etcd_with_auth, unique_id: str) -> None:
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="refused .*authentication failed"):
        create_handler(
            params(
                etcd_with_auth.endpoint, unique_id, user="root", password="wrong", retry_timeout=10
            )
        )
    assert time.monotonic() - started < 5  # not retried for retry_timeout


def test_password_file_authenticates(etcd_with_auth, tmp_path: Path, unique_id: str) -> None:
    secret = tmp_path / "password"
    secret.write_text(
        "s3cret\n"
    )  # a trailing newline, as `kubectl create secret --from-file` keeps
    with handler_connection(
        etcd_with_auth.endpoint, unique_id, user="root", password_file=str(secret)
    ) as connection:
        store = EtcdV3Store(connection, f"/test/{unique_id}/store")
        store.set("k", b"v")
        assert store.get("k") == b"v"


def test_missing_password_file_names_the_key(tmp_path: Path, unique_id: str) -> None:
    with pytest.raises(ValueError, match="rdzv-conf password_file: cannot read"):
        create_handler(
            params("127.0.0.1:2379", unique_id, user="root", password_file=str(tmp_path / "none"))
        )


def test_a_compare_set_rides_out_an_etcd_restart(own_etcd_server, unique_id: str) -> None:
    with handler_connection(own_etcd_server.endpoint, unique_id, retry_timeout=20) as connection:
        store = EtcdV3Store(connection, f"/test/{unique_id}/store")
        store.set("k", b"before")
        restarter = threading.Thread(target=own_etcd_server.restart, kwargs={"down_for": 2.0})
        restarter.start()
        time.sleep(0.3)  # etcd is down now
        result = store.compare_set("k", b"before", b"after")  # retried until etcd is back
        restarter.join(30)
        assert result == b"after"
        assert store.get("k") == b"after"


def test_rendezvous_completes_across_an_etcd_restart(own_etcd_server, unique_id: str) -> None:
    conf = {"retry_timeout": 20, "join_timeout": 60, "last_call_timeout": 1}
    results: dict[str, Any] = {}
    # A node's shutdown() ends the run for everyone (as torch's handlers do): leave only once both
    # have their rendezvous, or a slow second node finds the run closed.
    both_joined = threading.Barrier(2)

    def join(name: str) -> None:
        handler = create_handler(params(own_etcd_server.endpoint, unique_id, 2, 2, **conf))
        try:
            info = handler.next_rendezvous()
            results[name] = (info.rank, info.world_size)
        except Exception as exc:  # surfaced by the assertion below
            results[name] = exc
        finally:
            with contextlib.suppress(threading.BrokenBarrierError):
                both_joined.wait(timeout=90)
            handler.shutdown()

    first = threading.Thread(target=join, args=("a",))
    first.start()
    time.sleep(1.0)  # node a has joined and waits for node b
    own_etcd_server.restart(down_for=3.0)
    second = threading.Thread(target=join, args=("b",))
    second.start()
    first.join(90)
    second.join(90)
    assert sorted(results) == ["a", "b"], results
    assert sorted(r[0] for r in results.values()) == [0, 1], results
    assert all(r[1] == 2 for r in results.values()), results


class _LoseFirstTxnResponse:
    """Proxy of an etcd3 client whose first transaction applies, then 'loses' its response."""

    def __init__(self, real: Any, etcd3: Any) -> None:
        self._real, self._etcd3, self.lost = real, etcd3, 0

    def transaction(self, *args: Any, **kwargs: Any) -> Any:
        result = self._real.transaction(*args, **kwargs)
        if self.lost == 0:
            self.lost += 1
            raise self._etcd3.exceptions.ConnectionTimeoutError()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def test_a_retried_add_never_applies_twice(etcd_server, unique_id: str) -> None:
    connection = EtcdConnection(
        EtcdClientConfig(endpoints=parse_endpoints(etcd_server.endpoint)), sleep=lambda _s: None
    )
    store = EtcdV3Store(connection, f"/test/{unique_id}/store")
    store.set("n", b"10")
    proxy = _LoseFirstTxnResponse(connection.client(), connection.etcd3)
    connection._client = proxy
    connection._fail_over = lambda *_: None  # keep the proxy in place across the retry
    assert store.add("n", 5) == 15
    assert proxy.lost == 1
    assert store.get("n") == b"15"


def test_a_member_without_a_leader_refuses_at_once(tmp_path: Path, unique_id: str) -> None:
    """Two of three members die: the last one has no leader. A round write sent to it is refused
    at once ("no leader", etcd's WithRequireLeader metadata) and retried, instead of being held
    for its whole deadline by a member that cannot commit it."""
    from rendezvous import etcd_ops
    from rendezvous.etcd_server import local_cluster

    with local_cluster(tmp_path / "etcd", 3) as servers:
        survivor, *doomed = servers
        connection = EtcdConnection(
            EtcdClientConfig(endpoints=parse_endpoints(survivor.endpoint), retry_timeout=2.0)
        )
        try:
            etcd_ops.put_key(connection, f"/test/{unique_id}/k", b"v", what="a write with a quorum")
            for server in doomed:
                server.stop(kill=True)
            time.sleep(
                1.5
            )  # election timeout 0.5 s: the survivor has noticed that it has no leader
            started = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match="no leader"):
                etcd_ops.put_key(
                    connection,
                    f"/test/{unique_id}/k",
                    b"w",
                    what="a write without a quorum",
                    deadline=5.0,
                )
            took = time.monotonic() - started
        finally:
            connection.close()
    assert took < 4.0, (
        f"the attempts were held {took:.1f} s, not refused (a 5 s deadline, a 2 s retry budget)"
    )


def test_writes_go_to_the_leader_and_outlive_its_death_without_a_deadline(
    tmp_path: Path, unique_id: str
) -> None:
    """Requests go to the leader, not through the connection's home member (a follower). The
    leader is SIGKILLed while four threads write: a write a follower had forwarded to it would be
    lost without a word and held for its 10 s deadline (etcd's own request timeout is 6 s); sent to
    the leader, it fails at once and is retried on the new leader within the election."""
    from rendezvous import etcd_ops

    with local_cluster(tmp_path / "etcd", 3) as servers:
        leader, *followers = leader_first(servers)
        home = followers[0]
        config = EtcdClientConfig(
            endpoints=parse_endpoints(",".join(s.endpoint for s in [home, *followers[1:], leader])),
            read_timeout=10.0,
            retry_timeout=20.0,
        )
        connection = EtcdConnection(config)
        stop = threading.Event()
        writes: list[tuple[float, float]] = []
        errors: list[BaseException] = []

        def writer(n: int) -> None:
            i = 0
            while not stop.is_set():
                started = time.monotonic()
                try:
                    etcd_ops.put_key(
                        connection, f"/test/{unique_id}/w{n}", str(i).encode(), what="a write"
                    )
                except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                    errors.append(exc)
                    return
                writes.append((started, time.monotonic()))
                i += 1

        try:
            etcd_ops.put_key(connection, f"/test/{unique_id}/first", b"v", what="a write")
            assert str(connection.leader_endpoint) == leader.endpoint
            assert str(connection.endpoint) == home.endpoint
            threads = [threading.Thread(target=writer, args=(n,), daemon=True) for n in range(4)]
            for thread in threads:
                thread.start()
            time.sleep(1.0)
            killed_at = time.monotonic()
            leader.stop(kill=True)
            time.sleep(3.0)
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
            new_leader = leader_first(followers)[0]
            after = etcd_ops.put_key(connection, f"/test/{unique_id}/after", b"v", what="a write")
        finally:
            stop.set()
            connection.close()
    assert not errors, errors
    across = [end - start for start, end in writes if start <= killed_at <= end]
    assert across, "no write was in flight when the leader died"
    assert max(across) < 4.5, (
        f"a write in flight at the leader's death took {max(across):.1f} s (held, not refused)"
    )
    assert any(start > killed_at for start, _ in writes), (
        "no write succeeded after the leader's death"
    )
    assert after > 0 and str(connection.endpoint) == home.endpoint
    assert str(connection.leader_endpoint) == new_leader.endpoint


def test_an_outage_is_one_line_when_it_begins_and_one_when_it_ends(
    own_etcd_server, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 40 item 7: two connections of one process retrying through a 2 s etcd restart say
    it twice in all (begins, answers again), not a line per retry."""
    config = EtcdClientConfig(endpoints=parse_endpoints(own_etcd_server.endpoint), retry_timeout=20)
    connections = [EtcdConnection(config) for _ in range(2)]
    try:
        for connection in connections:
            connection.check()
        restarter = threading.Thread(target=own_etcd_server.restart, kwargs={"down_for": 2.0})
        restarter.start()
        time.sleep(0.3)  # etcd is down now
        with caplog.at_level("DEBUG", logger="rendezvous.etcd_client"):
            callers = [threading.Thread(target=c.check) for c in connections]
            for caller in callers:
                caller.start()
            for caller in callers:
                caller.join(30)
        restarter.join(30)
    finally:
        for connection in connections:
            connection.close()
    said = [r for r in caplog.records if r.levelno >= 30 and r.name == "rendezvous.etcd_client"]
    lines = [r.getMessage() for r in said]
    assert len(lines) == 2, lines
    assert "does not answer" in lines[0] and "one line when it answers again" in lines[0]
    assert lines[1].startswith(f"etcd at {own_etcd_server.endpoint} answers again (after ")
    retries = [r for r in caplog.records if "; retry " in r.getMessage()]
    assert retries and all(r.levelno == 10 for r in retries), "each retry at DEBUG only"
