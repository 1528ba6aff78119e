"""Recovery paths of the lease rendezvous with real etcd and real node processes (no training):
fast close, lease expiry, graceful leave, join, steady-state cost."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rendezvous.handler import create_handler

pytestmark = pytest.mark.integration

NODE = str(Path(__file__).with_name("scripts") / "rdzv_node.py")


class Node:
    """A rendezvous node in its own process, driven over stdin."""

    def __init__(self, endpoint: str, run_id: str, nnodes: tuple[int, int], conf: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, NODE, endpoint, run_id, str(nnodes[0]), str(nnodes[1]), conf],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.node_id = self._read(60)["node"]

    def _read(self, timeout: float) -> dict[str, Any]:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.process.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not result or not result[0]:
            raise TimeoutError(f"node gave no answer within {timeout}s")
        return json.loads(result[0])  # type: ignore[no-any-return]

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def ask(self, command: str, timeout: float = 60) -> dict[str, Any]:
        self.send(command)
        return self._read(timeout)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def leave(self) -> None:
        self.send("exit")
        self.process.wait(30)


@pytest.fixture
def nodes():  # type: ignore[no-untyped-def]
    started: list[Node] = []
    yield started
    for node in started:
        if node.process.poll() is None:
            node.kill()


def conf(**extra: Any) -> str:
    base = {"last_call_timeout": 30, "lease_ttl": 3, "join_timeout": 60, "retry_timeout": 10}
    return ",".join(f"{k}={v}" for k, v in {**base, **extra}.items())


def join_all(*members: Node, timeout: float = 60) -> list[dict[str, Any]]:
    for node in members:
        node.send("join")
    return [node._read(timeout) for node in members]


def test_first_round_closes_at_max_without_last_call(etcd_server, unique_id, nodes) -> None:  # type: ignore[no-untyped-def]
    nodes += [Node(etcd_server.endpoint, unique_id, (1, 2), conf()) for _ in range(2)]
    results = join_all(*nodes)
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["world_size"] == 2 and r["seconds"] < 10 for r in results)  # last call is 30 s


def test_fast_close_after_a_restart(etcd_server, unique_id, nodes) -> None:  # type: ignore[no-untyped-def]
    """Every live member rejoins: the round closes at once, not after the last call.

    The first round (two of at most three nodes) has to wait its last call out; 8 s instead of
    the usual 30 s keeps that wait short and still far above the 3 s the rejoin may take."""
    last_call_s = 8
    nodes += [
        Node(etcd_server.endpoint, unique_id, (1, 3), conf(last_call_timeout=last_call_s))
        for _ in range(2)
    ]
    first = {n.node_id: r for n, r in zip(nodes, join_all(*nodes, timeout=90), strict=True)}
    assert all(r["seconds"] >= last_call_s - 1 for r in first.values()), first  # it waited
    again = join_all(*nodes)
    assert all(r["seconds"] < 3 for r in again), again
    assert [r["round"] for r in again] == [1, 1]
    # ranks are stable across rounds
    assert {n.node_id: r["rank"] for n, r in zip(nodes, again, strict=True)} == {
        k: v["rank"] for k, v in first.items()
    }


def test_lease_expiry_lets_survivors_go_on(etcd_server, unique_id, nodes) -> None:  # type: ignore[no-untyped-def]
    survivor, doomed = (Node(etcd_server.endpoint, unique_id, (1, 2), conf()) for _ in range(2))
    nodes += [survivor, doomed]
    join_all(survivor, doomed)
    doomed.kill()  # no goodbye: its lease (3 s) must expire
    started = time.monotonic()
    result = survivor.ask("join", timeout=30)
    elapsed = time.monotonic() - started
    assert result["world_size"] == 1 and result["rank"] == 0
    assert elapsed < 3 + 3, elapsed  # lease TTL + margin


def test_graceful_leave_is_seen_at_once(etcd_server, unique_id, nodes) -> None:  # type: ignore[no-untyped-def]
    survivor, leaver = (
        Node(etcd_server.endpoint, unique_id, (1, 2), conf(lease_ttl=30)) for _ in range(2)
    )
    nodes += [survivor, leaver]
    join_all(survivor, leaver)
    leaver.leave()  # normal exit revokes its lease
    result = survivor.ask("join", timeout=30)
    assert result["world_size"] == 1 and result["seconds"] < 2, result


def test_sigterm_leaves_at_once(etcd_server, unique_id, nodes) -> None:  # type: ignore[no-untyped-def]
    """Scale-down: SIGTERM makes the launcher exit (torchrun turns it into an exception), its
    lease is revoked on the way out, and the survivor does not wait for it to expire."""
    survivor, leaver = (
        Node(etcd_server.endpoint, unique_id, (1, 2), conf(lease_ttl=30)) for _ in range(2)
    )
    nodes += [survivor, leaver]
    join_all(survivor, leaver)
    leaver.process.send_signal(signal.SIGTERM)
    assert leaver.process.wait(10) == 143
    result = survivor.ask("join", timeout=30)
    assert result["world_size"] == 1 and result["seconds"] < 2, result


def test_a_joining_node_is_seen_through_the_watch(etcd_server, unique_id, nodes) -> None:  # type: ignore[no-untyped-def]
    first = Node(etcd_server.endpoint, unique_id, (1, 2), conf(last_call_timeout=1))
    nodes.append(first)
    assert first.ask("join")["world_size"] == 1
    assert first.ask("waiting")["waiting"] == 0
    newcomer = Node(etcd_server.endpoint, unique_id, (1, 2), conf(last_call_timeout=1))
    nodes.append(newcomer)
    newcomer.send("join")
    deadline = time.monotonic() + 5
    while first.ask("waiting")["waiting"] == 0:
        assert time.monotonic() < deadline, "the running node never saw the newcomer"
        time.sleep(0.05)
    started = time.monotonic()
    rejoined = first.ask("join")
    joined = newcomer._read(30)
    assert rejoined["world_size"] == joined["world_size"] == 2
    assert (rejoined["rank"], joined["rank"]) == (0, 1)  # the running node keeps rank 0
    assert time.monotonic() - started < 3


def test_a_full_job_keeps_running_while_a_spare_waits(etcd_server, unique_id, nodes) -> None:  # type: ignore[no-untyped-def]
    members = [Node(etcd_server.endpoint, unique_id, (1, 2), conf()) for _ in range(2)]
    nodes += members
    join_all(*members)
    spare = Node(etcd_server.endpoint, unique_id, (1, 2), conf())
    nodes.append(spare)
    spare.send("join")
    time.sleep(1.5)
    assert [m.ask("waiting")["waiting"] for m in members] == [0, 0]  # no restart for a spare
    members[1].leave()
    result = members[0].ask("join")
    assert result["world_size"] == 2  # the spare took the free slot
    assert spare._read(30)["rank"] == 1


def test_steady_state_costs_only_lease_keep_alives(etcd_server, unique_id) -> None:  # type: ignore[no-untyped-def]
    handler = create_handler(
        RendezvousParameters("etcd-v3", etcd_server.endpoint, unique_id, 1, 1, lease_ttl=3)
    )
    try:
        handler.next_rendezvous()
        connection = handler._connection  # type: ignore[attr-defined]
        before, started = dict(connection.request_counts), time.monotonic()
        while time.monotonic() - started < 3.0:  # the agent asks every monitor interval
            assert handler.num_nodes_waiting() == 0
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        spent = {
            k: v - before.get(k, 0)
            for k, v in connection.request_counts.items()
            if v != before.get(k, 0)
        }
        keep_alives = spent.pop("a lease keep-alive", 0)
        assert spent == {}, f"requests besides keep-alives: {spent}"
        assert keep_alives <= elapsed / 1.0 + 1, keep_alives  # one every ttl/3 = 1 s
    finally:
        handler.shutdown()


def test_shutdown_closes_the_run_for_late_nodes(etcd_server, unique_id) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    params = RendezvousParameters("etcd-v3", etcd_server.endpoint, unique_id, 1, 1)
    first = create_handler(params)
    first.next_rendezvous()
    assert first.shutdown() is True
    late = create_handler(params)
    try:
        assert late.is_closed()
        with pytest.raises(RendezvousClosedError):
            late.next_rendezvous()
    finally:
        late.leave()  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", ["shutdown", "leave"])
def test_no_thread_of_a_handler_outlives_it(etcd_server, unique_id, how) -> None:  # type: ignore[no-untyped-def]
    """A handler built by create_handler owns its etcd connection: shutting down or leaving ends
    the connection's keep-alive, watch and task threads (nothing keeps renewing or watching in a
    process that goes on, such as a test run or a launcher that retries)."""
    before = set(threading.enumerate())
    handler = create_handler(RendezvousParameters("etcd-v3", etcd_server.endpoint, unique_id, 1, 1))
    handler.next_rendezvous()
    started = [t for t in threading.enumerate() if t not in before and t.name.startswith("etcd-v3")]
    assert {t.name for t in started} >= {"etcd-v3-keepalive", "etcd-v3-watch"}, started
    getattr(handler, how)()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [t.name for t in started if t.is_alive()] == []


def test_a_frozen_member_triggers_a_restart_after_its_lease(etcd_server, unique_id, nodes) -> None:  # type: ignore[no-untyped-def]
    """A partitioned or frozen peer raises no error in the survivors' collectives; its expired
    lease must make the survivors' agents restart and re-rendezvous without it."""
    survivor, frozen = (Node(etcd_server.endpoint, unique_id, (1, 2), conf()) for _ in range(2))
    nodes += [survivor, frozen]
    join_all(survivor, frozen)
    assert survivor.ask("waiting")["waiting"] == 0
    frozen.process.send_signal(signal.SIGSTOP)  # alive but silent: no keep-alives
    try:
        deadline = time.monotonic() + 3 + 4  # lease_ttl 3 s + margin
        while survivor.ask("waiting")["waiting"] == 0:
            assert time.monotonic() < deadline, "the survivor never noticed the frozen member"
            time.sleep(0.2)
        result = survivor.ask("join", timeout=30)
        assert result["world_size"] == 1
    finally:
        frozen.process.send_signal(signal.SIGCONT)


def test_join_after_the_lease_expired_registers_again(etcd_server, unique_id) -> None:  # type: ignore[no-untyped-def]
    """After a partition longer than lease_ttl, etcd has dropped the node's lease: the next join
    must register under a new lease instead of failing with 'requested lease not found'."""
    params = RendezvousParameters("etcd-v3", etcd_server.endpoint, unique_id, 1, 1, lease_ttl=3)
    handler = create_handler(params)
    try:
        handler.next_rendezvous()
        lease = handler._lease  # type: ignore[attr-defined]
        old = lease._lease_id
        lease._keeper.forget(old)  # no more keep-alives: as if cut off from etcd
        handler._connection.call(lambda c: c.revoke_lease(old), what="expire")  # type: ignore[attr-defined]
        info = handler.next_rendezvous()
        assert info.world_size == 1
        assert lease._lease_id not in (None, old)
    finally:
        handler.shutdown()


class InProcess:
    """Two or more handlers of one run in this process; joins run in threads (they block)."""

    def __init__(self, endpoint: str, run_id: str, count: int, **conf: Any) -> None:
        settings = {
            "last_call_timeout": 30,
            "lease_ttl": 3,
            "join_timeout": 60,
            "retry_timeout": 10,
            **conf,
        }
        params = RendezvousParameters("etcd-v3", endpoint, run_id, count, count, **settings)
        self.handlers = [create_handler(params) for _ in range(count)]

    def join(self, *handlers: Any) -> list[Any]:
        """``next_rendezvous`` on each handler at once; the infos in the same order."""
        infos: dict[int, Any] = {}
        errors: list[BaseException] = []

        def one(i: int, handler: Any) -> None:
            try:
                infos[i] = handler.next_rendezvous()
            except BaseException as exc:  # re-raised below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i, h)) for i, h in enumerate(handlers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        if errors:
            raise errors[0]
        assert len(infos) == len(handlers), "a join did not return within 60 s"
        return [infos[i] for i in range(len(handlers))]

    def close(self) -> None:
        for handler in self.handlers:
            handler._watch.cancel()
            handler._finalizer()
            handler._connection.close()


def watch_caught_up(handler: Any, timeout: float = 15.0) -> None:
    """Return once ``handler``'s watch has processed every event written so far.

    Positive evidence for "nobody waiting" checks: a marker key is written under the watched
    prefix (the handler ignores keys it does not know), and etcd delivers a watch's events in
    revision order, so once the marker went through the handler so did every earlier event.
    """
    watch = handler._watch
    marker = f"{watch._prefix}test-marker-{time.monotonic_ns()}"
    processed = threading.Event()
    original = watch._on_event

    def recording(event: Any) -> None:
        original(event)  # first the handler, then the record: "seen" means "processed"
        if event.key.decode() == marker:
            processed.set()

    watch._on_event = recording
    try:
        handler._connection.call(lambda c: c.put(marker, b""), what="a test marker")
        assert processed.wait(timeout), (
            f"the watch did not deliver a marker written under its prefix within {timeout}s"
        )
    finally:
        watch._on_event = original
        handler._connection.call(lambda c: c.delete(marker), what="a test marker")


@pytest.fixture
def pair(etcd_server, unique_id):  # type: ignore[no-untyped-def]
    nodes = InProcess(etcd_server.endpoint, unique_id, 2)
    yield nodes
    nodes.close()


def test_a_restart_round_leaves_nothing_waiting(pair) -> None:  # type: ignore[no-untyped-def]
    """A worker SIGKILL on node b: b's agent rejoins, a's agent sees the new round and rejoins
    too. Once that round has closed, neither node may see a node waiting -- not the previous
    round's join keys, not its own rejoin -- or the group restarts once more for nothing."""
    a, b = pair.handlers
    pair.join(a, b)
    assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)
    joined: list[Any] = []
    rejoin = threading.Thread(
        target=lambda: joined.append(b.next_rendezvous())
    )  # b's agent restarts
    rejoin.start()
    deadline = time.monotonic() + 10
    while a.num_nodes_waiting() == 0:  # a's monitor loop notices the round b opened
        assert time.monotonic() < deadline, "node a never saw the round that b opened"
        time.sleep(0.05)
    (info_a,) = pair.join(a)
    rejoin.join(30)
    assert joined and {info_a.rank, joined[0].rank} == {0, 1}
    assert a._round == b._round == 1
    watch_caught_up(a)
    watch_caught_up(b)
    assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)


def wait_until_the_departure_was_seen(survivor: Any, node_id: str, timeout: float = 15.0) -> None:
    """Return once ``survivor`` coordinates the run and its coordinator's view has lost ``node_id``.

    Positive evidence for tests that assert that something did not happen after a departure:
    departures reach the coordinator only (the leaver may have held the role: the survivor then
    claims it and starts from a fresh read), so only once it has processed this one does "no
    restart" mean anything.
    """
    deadline = time.monotonic() + timeout
    while True:
        coordinator = survivor._coordinator
        if (
            coordinator is not None
            and coordinator.running
            and node_id not in coordinator.live_nodes()
        ):
            return
        assert time.monotonic() < deadline, (
            f"the survivor's coordinator never saw {node_id} leave within {timeout}s"
        )
        time.sleep(0.02)


@pytest.mark.parametrize("after_a_restart", [False, True], ids=["first-round", "after-a-restart"])
def test_a_finished_job_does_not_restart_the_last_node(pair, after_a_restart) -> None:  # type: ignore[no-untyped-def]
    """Node a's workers finish first; its launcher shuts the rendezvous down and leaves
    (torchrun: exit barrier, ``shutdown()``, lease revoked) while node b's workers are still
    finishing. Once b's watch has processed a's departure, b's monitor loop must see nobody
    waiting: a finished job's departures are no membership change (no restart of a finished job)."""
    a, b = pair.handlers
    pair.join(a, b)
    if after_a_restart:
        pair.join(b, a)  # the restart round: b rejoined first
        assert a._round == b._round == 1
    assert b.num_nodes_waiting() == 0
    assert a.shutdown() is True
    wait_until_the_departure_was_seen(b, a.node_id)
    assert b.num_nodes_waiting() == 0
    assert b.is_closed()


def test_a_finished_node_leaving_is_logged_as_news_not_as_a_loss(pair, caplog) -> None:  # type: ignore[no-untyped-def]
    """The operator's side of the same departure: the survivor logs it at INFO, never as a lost
    node (a WARNING at every normal finish reads like the cause of a restart)."""
    a, b = pair.handlers
    pair.join(a, b)
    caplog.set_level(logging.INFO, logger="rendezvous")
    assert a.shutdown() is True
    wait_until_the_departure_was_seen(b, a.node_id)

    def records_about_a() -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if r.name.startswith("rendezvous.") and a.node_id in r.getMessage()
        ]

    # A survivor that just claimed the coordinator role can see the departure (its first read) a
    # moment before it logs it (CI, on a loaded machine): wait for its word, at whatever level.
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not [
        r
        for r in records_about_a()
        if r.levelno >= logging.WARNING or "left the closed run" in r.getMessage()
    ]:
        time.sleep(0.02)
    about_a = records_about_a()
    assert [r.getMessage() for r in about_a if r.levelno >= logging.WARNING] == []
    left = [r for r in about_a if "left the closed run" in r.getMessage()]
    assert [r.levelno for r in left] == [logging.INFO], [r.getMessage() for r in about_a]


def test_a_member_that_leaves_a_running_job_is_noticed(pair) -> None:  # type: ignore[no-untyped-def]
    """The contrast: a member that leaves without closing the run (its launcher died, scale-down)
    is a membership change -- the survivor restarts and goes on without it."""
    a, b = pair.handlers
    pair.join(a, b)
    a._finalizer()  # lease revoked, run left open
    deadline = time.monotonic() + 5
    while b.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "the survivor never noticed the member that left"
        time.sleep(0.05)


def test_status_reads_the_stored_node_values_over_one_connection(
    etcd_server, unique_id, pair, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """``elastic-trainer status`` on a live run: addresses and pids come from the values the
    nodes stored with their keys (not from their ids), read over a single etcd connection."""
    import os

    from elastic_trainer.ops.status import read_status
    from rendezvous.etcd_client import EtcdConnection
    from rendezvous.lease_handler import NodeInfo

    a, b = pair.handlers
    pair.join(a, b)
    # A spare whose id says nothing about where it runs: only its stored value can.
    connection = a._connection
    lease = connection.call(lambda c: c.lease(30), what="a test lease")
    spare_value = NodeInfo("10.9.8.7", 4321).encode()
    connection.call(
        lambda c: c.put(a._keys.node("spare"), spare_value, lease=lease), what="a test put"
    )
    opened: list[EtcdConnection] = []
    real_init = EtcdConnection.__init__

    def counting_init(self: EtcdConnection, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(EtcdConnection, "__init__", counting_init)
    report = read_status(etcd_server.endpoint, unique_id, {"retry_timeout": "5"}, None)
    assert len(opened) == 1
    assert report["handler"] == "lease" and report["found"] and report["complete"]
    assert {(p["node"], p["addr"], p["pid"]) for p in report["participants"]} == {
        (a.node_id, a._addr, os.getpid()),
        (b.node_id, b._addr, os.getpid()),
    }
    waiting = [
        {k: w[k] for k in ("node", "addr", "pid")} for w in report["waiting"]
    ]  # other fields may come
    assert waiting == [{"node": "spare", "addr": "10.9.8.7", "pid": 4321}]


def test_a_node_that_leaves_while_joining_never_registers_again(etcd_server, unique_id) -> None:  # type: ignore[no-untyped-def]
    """``leave()`` while another thread waits in ``next_rendezvous`` (a launcher leaving from its
    signal path; the scale benchmark's 10 % leaving at once): the join ends at once with
    RendezvousClosedError and the node stays gone. Before, the join loop granted a new lease and
    registered the node again: a live node that never joined, which a restart round waits for."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    nodes = InProcess(etcd_server.endpoint, unique_id, 2)
    try:
        stayer, leaver = nodes.handlers
        outcome: list[BaseException | None] = []

        def join() -> None:
            try:
                leaver.next_rendezvous()  # min 2: waits for the stayer, which never joins
                outcome.append(None)
            except BaseException as exc:  # checked in the test's thread
                outcome.append(exc)

        thread = threading.Thread(target=join)
        thread.start()
        node_key = stayer._keys.node(leaver.node_id)

        def registered() -> bool:
            return (
                stayer._connection.call(lambda c: c.get(node_key), what="a test read")[0]
                is not None
            )

        deadline = time.monotonic() + 15
        while leaver._lease.current() is None or not registered():
            assert time.monotonic() < deadline, "the leaver never registered"
            time.sleep(0.05)
        left_at = time.monotonic()
        leaver.leave()
        thread.join(10)
        assert not thread.is_alive(), "the join went on after the node left"
        assert isinstance(outcome[0], RendezvousClosedError), outcome
        assert time.monotonic() - left_at < 5
        time.sleep(1.0)  # a re-registration would have happened by now
        assert not registered(), "the node registered again"
    finally:
        nodes.close()
