"""Peer heartbeats on loopback UDP: who is watched, when a silent node is reported, what is not."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from elastic_trainer.launch.peer_heartbeat import PeerHeartbeats, parse_address, ring_neighbours
from elastic_trainer.ops.processes import wait_for

FAST = {"interval_s": 0.02, "silent_after_s": 0.25}


class Reports:
    def __init__(self) -> None:
        self.nodes: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, node: str) -> None:
        with self.lock:
            self.nodes.append(node)


@pytest.fixture
def made() -> Iterator[list[PeerHeartbeats]]:
    beats: list[PeerHeartbeats] = []
    try:
        yield beats
    finally:
        for b in beats:
            b.close()


def _start(
    made: list[PeerHeartbeats], node: str, reports: Reports, run_id: str = "job", **kwargs: object
) -> PeerHeartbeats:
    beats = PeerHeartbeats(
        run_id=run_id,
        node=node,
        advertise_host="127.0.0.1",
        on_silent=reports,
        **{**FAST, **kwargs},
    )  # type: ignore[arg-type]
    made.append(beats)
    return beats


def test_ring_neighbours_send_after_and_watch_before() -> None:
    nodes = ["a", "b", "c", "d", "e"]
    assert ring_neighbours(nodes, "b", 2) == (["c", "d"], ["a", "e"])
    assert ring_neighbours(nodes, "e", 2) == (["a", "b"], ["d", "c"])
    # Everyone is watched by exactly `fanout` others, whatever the size.
    for size in range(2, 9):
        ring = [f"n{i}" for i in range(size)]
        watchers = {n: 0 for n in ring}
        for n in ring:
            for target in ring_neighbours(ring, n, 2)[0]:
                watchers[target] += 1
        assert set(watchers.values()) == {min(2, size - 1)}
    assert ring_neighbours(["a"], "a", 2) == ([], [])
    assert ring_neighbours(["a", "b"], "a", 2) == (["b"], ["b"])


def test_parse_address() -> None:
    assert parse_address("10.0.0.5:4000") == ("10.0.0.5", 4000)
    assert parse_address("[::1]:4000") == ("::1", 4000)
    for bad in ("10.0.0.5", ":4000", "host:port"):
        with pytest.raises(ValueError, match="host:port"):
            parse_address(bad)


def test_bad_timing_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        PeerHeartbeats(
            run_id="j",
            node="a",
            advertise_host="127.0.0.1",
            on_silent=print,
            interval_s=1.0,
            silent_after_s=0.5,
        )


def test_a_node_that_stops_is_reported_once_and_again_after_it_came_back(
    made: list[PeerHeartbeats],
) -> None:
    reports_a, reports_b = Reports(), Reports()
    a, b = _start(made, "a", reports_a), _start(made, "b", reports_b)
    a.set_peers({"b": b.address})
    b.set_peers({"a": a.address})
    wait_for(
        lambda: "b" in a.heard() and "a" in b.heard(), timeout=2.0, what="each hears the other"
    )
    time.sleep(0.5)  # both alive: two silent_after_s without a report
    assert reports_a.nodes == [] and reports_b.nodes == []
    assert not a.still_silent("b")

    port = parse_address(b.address)[1]
    b.close()
    stopped = time.monotonic()
    wait_for(
        lambda: reports_a.nodes == ["b"],
        timeout=2.0,
        what="b reported silent",
        describe=lambda: str(reports_a.nodes),
    )
    assert time.monotonic() - stopped >= 0.2  # not before silent_after_s (less a tick)
    assert a.still_silent("b")
    time.sleep(0.5)
    assert reports_a.nodes == ["b"], "reported once while it stays silent"

    # b comes back (a new process, here on the same port): heard again, and reportable again.
    again = Reports()
    b2 = PeerHeartbeats(run_id="job", node="b", advertise_host="127.0.0.1", on_silent=again, **FAST)
    made.append(b2)
    if parse_address(b2.address)[1] != port:
        a.set_peers({"b": b2.address})
    b2.set_peers({"a": a.address})
    wait_for(
        lambda: "a" in b2.heard() and a.heard().get("b", 0) > stopped,
        timeout=2.0,
        what="b heard again",
    )
    b2.close()
    wait_for(
        lambda: reports_a.nodes == ["b", "b"],
        timeout=2.0,
        what="b reported silent again",
        describe=lambda: str(reports_a.nodes),
    )


def test_a_node_never_heard_is_never_reported(made: list[PeerHeartbeats]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))  # a peer that receives and never sends (UDP blocked one way)
        reports = Reports()
        a = _start(made, "a", reports)
        a.set_peers({"b": f"127.0.0.1:{silent.getsockname()[1]}"})
        silent.settimeout(2.0)
        data = silent.recv(512)
        assert data == b"job\na"  # a does send
        time.sleep(0.6)
        assert reports.nodes == []


def test_datagrams_of_another_job_do_not_count(made: list[PeerHeartbeats]) -> None:
    reports = Reports()
    a = _start(made, "a", reports, run_id="job-1")
    other = _start(made, "b", Reports(), run_id="job-2")
    a.set_peers({"b": other.address})
    other.set_peers({"a": a.address})
    time.sleep(0.4)
    assert "b" not in a.heard() and reports.nodes == []


def test_a_node_watched_only_from_now_gets_a_full_silence_before_a_report(
    made: list[PeerHeartbeats],
) -> None:
    """Ring changes reach nodes at different times: a node newly watched may not send here yet."""
    reports = Reports()
    a = _start(made, "a", reports, fanout=1)
    c = _start(made, "c", Reports(), fanout=1)
    a.set_peers({"c": c.address})
    c.set_peers({"a": a.address})
    wait_for(lambda: "c" in a.heard(), timeout=2.0, what="a hears c")  # two nodes: a watches c
    d = _start(made, "d", Reports(), fanout=1)
    everyone = {"a": a.address, "c": c.address, "d": d.address}
    for beats in (a, c, d):
        beats.set_peers({k: v for k, v in everyone.items() if k != beats.node})
    # Ring a -> c -> d -> a: a watches d; c sends to d only (after one silence of lingering
    # beats to a), so a's news of c gets old.
    wait_for(lambda: "d" in a.heard(), timeout=2.0, what="a hears d")
    time.sleep(0.9)
    assert time.monotonic() - a.heard()["c"] > 0.4
    d.close()
    # d leaves cleanly (its key deleted): a watches c again, which still sends to d until its own
    # view changes. a must not report c for a silence it could not have heard.
    a.set_peers({"c": c.address})
    time.sleep(0.15)
    c.set_peers({"a": a.address})
    time.sleep(0.5)
    assert reports.nodes == []
    assert time.monotonic() - a.heard()["c"] < 0.2


def test_a_former_target_keeps_getting_beats_for_one_silence(made: list[PeerHeartbeats]) -> None:
    """A ring change reaches nodes at different times: the node this one stops sending to may
    still watch it, and must not find it silent before its own view changes."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as old_target:
        old_target.bind(("127.0.0.1", 0))
        old_target.settimeout(0.05)
        a = _start(made, "a", Reports(), fanout=1)
        old = f"127.0.0.1:{old_target.getsockname()[1]}"
        a.set_peers({"b": old})
        assert old_target.recv(512) == b"job\na"
        other = _start(made, "aa", Reports(), fanout=1)  # sorts between a and b: a now sends to aa
        a.set_peers({"aa": other.address, "b": old})
        changed = time.monotonic()
        last = changed
        while time.monotonic() - changed < 1.0:
            try:
                old_target.recv(512)
                last = time.monotonic()
            except TimeoutError:
                pass
        assert 0.15 < last - changed < 0.45, (
            f"beats to the former target for one silence (0.25 s): {last - changed:.2f}"
        )


def test_a_newcomer_is_not_taken_for_blocked_udp(
    made: list[PeerHeartbeats], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A node that joins after the others were watched for long gets its own time to send: the
    'UDP blocked' warning named a newcomer at its first judgement (issue 31)."""
    import logging

    from elastic_trainer.launch import peer_heartbeat

    monkeypatch.setattr(peer_heartbeat, "NEVER_HEARD_WARNING_S", 0.4)
    reports = Reports()
    a = _start(made, "a", reports)
    b = _start(made, "b", Reports())
    a.set_peers({"b": b.address})
    b.set_peers({"a": a.address})
    wait_for(lambda: "b" in a.heard(), timeout=2.0, what="a hears b")
    time.sleep(0.5)  # watched for longer than the warning's bound
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as newcomer,
        caplog.at_level(logging.WARNING),
    ):
        newcomer.bind(("127.0.0.1", 0))  # b left; c joined and has not sent yet
        a.set_peers({"c": f"127.0.0.1:{newcomer.getsockname()[1]}"})
        time.sleep(0.2)
        assert not [r for r in caplog.records if "nothing heard" in r.getMessage()]
        wait_for(
            lambda: [r for r in caplog.records if "nothing heard from nodes c" in r.getMessage()],
            timeout=2.0,
            what="the warning once c had its time",
        )


def _voluntary_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt"))


def test_a_node_alone_sleeps_until_it_gets_peers(made: list[PeerHeartbeats]) -> None:
    """A one-node job has nobody to beat for: its heartbeat thread wakes no timer (it used to wake
    every interval), and a peer given later is beaten for at once."""
    reports = Reports()
    a = _start(made, "a", reports)
    tid = a._thread.native_id
    assert tid is not None
    time.sleep(0.1)  # settled into its wait
    before = _voluntary_switches(tid)
    time.sleep(0.5)  # 25 intervals of 0.02 s
    assert _voluntary_switches(tid) - before <= 1
    b = _start(made, "b", reports)
    b.set_peers({"a": a.address})
    a.set_peers({"b": b.address})
    wait_for(
        lambda: "a" in b.heard() and "b" in a.heard(), timeout=2.0, what="both hear each other"
    )
    assert reports.nodes == []
