"""EtcdConnection sends requests to etcd's leader: fake members that answer ``Status``, an
injected sleep (nothing waits)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from rendezvous import etcd_leader
from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints
from rendezvous.etcd_leader import LeaderRoute, MemberStatus


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"


class FakeCluster:
    """Three members ``a:1 b:2 c:3`` with ids 1, 2, 3; ``leader`` is what every live member says."""

    def __init__(self) -> None:
        self.ids = {"a:1": 1, "b:2": 2, "c:3": 3}
        self.leader = 2
        self.term = 5
        self.dead: set[str] = set()
        self.connected: list[str] = []
        self.status_asked: list[str] = []

    def connect(self, endpoint: Any) -> SimpleNamespace:
        name = str(endpoint)
        self.connected.append(name)
        return SimpleNamespace(name=name)

    def status(self, client: SimpleNamespace, timeout: float) -> MemberStatus:
        self.status_asked.append(client.name)
        if client.name in self.dead:
            raise Unavailable()
        return MemberStatus(self.ids[client.name], self.leader, self.term)


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeCluster, EtcdConnection, list[float]]:
    fake = FakeCluster()
    sleeps: list[float] = []
    conn = EtcdConnection(
        EtcdClientConfig(endpoints=parse_endpoints("a:1,b:2,c:3"), retry_timeout=1000),
        sleep=sleeps.append,
    )
    monkeypatch.setattr(conn, "_connect", fake.connect)
    monkeypatch.setattr("rendezvous.etcd_client.member_status", fake.status)
    return fake, conn, sleeps


def where(fake: FakeCluster) -> Any:
    def operation(client: SimpleNamespace) -> str:
        if client.name in fake.dead:
            raise Unavailable()
        return str(client.name)

    return operation


def test_requests_go_to_the_leader_and_the_lookup_is_kept(cluster) -> None:  # type: ignore[no-untyped-def]
    fake, conn, _ = cluster
    assert conn.call(where(fake), what="a write") == "b:2"
    assert conn.call(where(fake), what="a write") == "b:2"
    assert fake.status_asked == [
        "a:1",
        "b:2",
        "c:3",
    ]  # the home's leader id, then the others' ids, once
    assert str(conn.leader_endpoint) == "b:2" and str(conn.endpoint) == "a:1"
    assert conn.request_counts["leader lookup"] == 3 and conn.request_counts["a write"] == 2


def test_a_dead_leader_is_asked_about_again_and_the_home_member_stays(cluster) -> None:  # type: ignore[no-untyped-def]
    fake, conn, sleeps = cluster
    assert conn.call(where(fake), what="a write") == "b:2"
    fake.dead.add("b:2")  # the leader's process dies; the home member still names it for a while
    calls = {"n": 0}

    def operation(client: SimpleNamespace) -> str:
        calls["n"] += 1
        if calls["n"] == 2:
            fake.leader = 3  # elected while the second attempt failed
        return where(fake)(client)

    assert conn.call(operation, what="a write") == "c:3"
    assert len(sleeps) == 2  # two backoffs, no deadline waited out
    assert str(conn.endpoint) == "a:1" and fake.connected.count("a:1") == 1  # the home was not left
    assert str(conn.leader_endpoint) == "c:3"


def test_no_leader_is_retried_from_the_same_home_and_named_when_it_lasts(cluster) -> None:  # type: ignore[no-untyped-def]
    fake, conn, sleeps = cluster
    fake.leader = 0  # an election: every member answers, none knows a leader
    conn.config.retry_timeout = 0.3
    with pytest.raises(RendezvousConnectionError, match="no leader"):
        conn.call(where(fake), what="a write")
    assert len(sleeps) >= 2  # retried
    assert (
        str(conn.endpoint) == "a:1" and fake.connected.count("a:1") == 1
    )  # the home answered: kept
    assert conn.request_counts["a write"] == 0  # nothing was sent without a leader


def test_a_home_member_cut_off_from_the_leader_is_not_trusted_alone(
    cluster, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    fake, conn, _ = cluster
    real_status = fake.status

    def status(client: SimpleNamespace, timeout: float) -> MemberStatus:
        answer = real_status(client, timeout)
        return MemberStatus(answer.member_id, 0, 4) if client.name == "a:1" else answer

    monkeypatch.setattr("rendezvous.etcd_client.member_status", status)
    assert conn.call(where(fake), what="a write") == "b:2"  # what the others say
    assert str(conn.endpoint) == "a:1"


def test_threads_that_waited_for_a_failed_lookup_fail_at_once() -> None:
    """A home member that does not answer the lookup costs one deadline, not one per thread in
    a row: the threads that queued behind the failed lookup back off at once."""
    import threading

    from rendezvous.etcd_leader import LeaderUnknownError

    entered, release = threading.Event(), threading.Event()
    asked: list[str] = []

    def status(client: str, timeout: float) -> MemberStatus:
        asked.append(client)
        entered.set()
        release.wait(10)
        raise Unavailable()

    route = LeaderRoute(3, status)
    errors: list[BaseException] = []

    def find() -> None:
        try:
            route.find(0, "home", lambda i: f"side{i}", 10.0)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertions
            errors.append(exc)

    first = threading.Thread(target=find)
    first.start()
    assert entered.wait(10)
    waiting = [threading.Thread(target=find) for _ in range(5)]
    for thread in waiting:
        thread.start()
    release.set()
    for thread in [first, *waiting]:
        thread.join(10)
    assert asked == ["home"]
    assert sum(isinstance(e, Unavailable) for e in errors) == 1
    assert sum(isinstance(e, LeaderUnknownError) for e in errors) == 5


def test_a_lookup_refused_before_it_was_sent_is_not_counted(
    cluster, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    from rendezvous.etcd_client import NOT_SENT

    fake, conn, _ = cluster
    refused = [True]
    real_status = fake.status

    class Refused(Unavailable):
        def details(self) -> str:
            return "failed to connect to all addresses; last error: Connection refused"

    def status(client: SimpleNamespace, timeout: float) -> MemberStatus:
        if client.name == "a:1" and refused:
            refused.pop()
            raise Refused()
        return real_status(client, timeout)

    monkeypatch.setattr("rendezvous.etcd_client.member_status", status)
    assert conn.call(where(fake), what="a write") == "b:2"
    assert conn.request_counts["a write"] == 1 and conn.request_counts[NOT_SENT] == 1
    assert (
        conn.request_counts["leader lookup"] == 1
    )  # the new home b:2 names itself: nothing to probe


def test_a_leader_outside_the_endpoints_leaves_requests_on_the_home_member(cluster, caplog) -> None:  # type: ignore[no-untyped-def]
    fake, conn, _ = cluster
    fake.leader = 99  # e.g. the endpoints are a load balancer's addresses
    with caplog.at_level(logging.INFO, logger="rendezvous.etcd_leader"):
        assert conn.call(where(fake), what="a write") == "a:1"
    assert conn.leader_endpoint is None
    assert [r for r in caplog.records if "not among the configured endpoints" in r.getMessage()]


def test_a_home_member_that_does_not_answer_the_lookup_is_left(cluster) -> None:  # type: ignore[no-untyped-def]
    fake, conn, _ = cluster
    fake.dead.add("a:1")
    assert conn.call(where(fake), what="a write") == "b:2"
    assert (
        str(conn.endpoint) == "b:2"
    )  # the home moved on; b is also the leader: one client serves both


def test_an_old_belief_is_checked_again(cluster, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fake, conn, _ = cluster
    clock = [0.0]
    conn._route = LeaderRoute(3, conn._member_status, clock=lambda: clock[0])
    assert conn.call(where(fake), what="a write") == "b:2"
    fake.leader = 3  # moved without any request failing (e.g. a leadership transfer)
    assert conn.call(where(fake), what="a write") == "b:2"
    clock[0] += etcd_leader.BELIEF_S
    assert conn.call(where(fake), what="a write") == "c:3"


def test_streams_stay_on_the_home_member(cluster) -> None:  # type: ignore[no-untyped-def]
    fake, conn, _ = cluster
    assert conn.client().name == "a:1"
    assert fake.status_asked == []


def test_reads_are_served_by_the_home_member(cluster) -> None:  # type: ignore[no-untyped-def]
    fake, conn, _ = cluster
    assert conn.call(where(fake), what="a read", read=True) == "a:1"
    assert fake.status_asked == []  # no lookup for a read


def test_a_response_from_a_later_term_has_the_leader_asked_again(cluster) -> None:  # type: ignore[no-untyped-def]
    """The leader died while this process sent nothing, came back as a follower, and its channel
    reconnected without an error: the first response from the new term tells."""
    fake, conn, _ = cluster

    def response(client: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(name=client.name, header=SimpleNamespace(raft_term=fake.term))

    assert conn.call(response, what="a write").name == "b:2"
    fake.leader, fake.term = 3, 6  # an election: b still answers (as a follower, forwarding)
    assert conn.call(response, what="a write").name == "b:2"  # no failure; its header says term 6
    assert conn.call(response, what="a write").name == "c:3"
    assert conn.call(response, what="a write").name == "c:3"
    assert fake.status_asked.count("a:1") == 2  # once at first, once after the new term


def test_a_leader_client_with_an_expired_token_is_replaced(cluster) -> None:  # type: ignore[no-untyped-def]
    """The client kept for the leader authenticated once; when its token expires the retry
    connects (authenticates) again instead of failing on the same client until the deadline."""
    fake, conn, _ = cluster

    class TokenExpired(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAUTHENTICATED

        def details(self) -> str:
            return "etcdserver: invalid auth token"

    assert conn.call(where(fake), what="a write") == "b:2"
    expired = [TokenExpired()]

    def operation(client: SimpleNamespace) -> str:
        if expired:
            raise expired.pop()
        return where(fake)(client)

    assert conn.call(operation, what="a write") == "b:2"
    assert fake.connected.count("b:2") == 2  # the expired client was replaced
    assert str(conn.endpoint) == "a:1"  # the home member was not left
