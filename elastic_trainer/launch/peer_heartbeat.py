"""Heartbeats between the launchers of one job: a node cut off without a goodbye is suspected in
about a second, with no load on etcd.

    beats = PeerHeartbeats(run_id="job-1", node="a", advertise_host="10.0.0.5", on_silent=report)
    beats.set_peers({"b": "10.0.0.6:41234", "c": "10.0.0.7:40001"})   # from the nodes' etcd keys
    ...
    beats.close()

Every launcher sends one UDP datagram every ``interval_s`` (0.1 s) to the ``fanout`` (2) nodes
after it in name order (to every other node while the job has at most ``fanout + 1``), and listens
for the ``fanout`` nodes before it. So each node is watched by ``fanout`` others, and the cost per
node stays constant at any job size. A node that was heard and has been silent for
``silent_after_s`` (0.8 s) is reported once through ``on_silent`` (and again only after it was
heard again).

Invariants:
* a node never heard is never reported: where UDP between nodes is blocked, detection falls back
  to the nodes' liveness leases (one warning says so);
* a silence this process could not have seen (its own loop ran late, as on an overloaded host)
  is not reported: the loop reads every datagram that arrived before it judges;
* with no peer (a one-node job) the thread sleeps until :meth:`set_peers` gives it one: no
  timer wakes a node that has nobody to beat for;
* a report only suspects. The caller opens a heal round; a node wrongly suspected is alive,
  answers the round, and stays in the job (one heal, nothing lost).
Design: ``docs/design/heal-in-place.md`` (Detection).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

INTERVAL_S = 0.1
"""How often a launcher sends its heartbeat."""
SILENT_AFTER_S = 0.8
"""How long a node that was heard may stay silent before it is reported."""
FANOUT = 2
"""How many nodes after it each node sends to (and so how many watch each node)."""
NEVER_HEARD_WARNING_S = 10.0
"""After this long with peers and no datagram from any watched one, say that UDP looks blocked."""
_MAX_DATAGRAM = 512


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) -> ``(host, port)``.

    Raises:
        ValueError: not ``host:port``.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"heartbeat address {text!r} is not host:port")
    return host.strip("[]"), int(port)


def ring_neighbours(nodes: list[str], node: str, fanout: int) -> tuple[list[str], list[str]]:
    """``(send_to, watch)``: the ``fanout`` nodes after ``node`` in name order and the ``fanout``
    before it (cyclic; every other node when there are at most ``fanout + 1``)."""
    ring = sorted(set(nodes) | {node})
    others = len(ring) - 1
    if others <= 0:
        return [], []
    at = ring.index(node)
    count = min(fanout, others)
    send_to = [ring[(at + i) % len(ring)] for i in range(1, count + 1)]
    watch = [ring[(at - i) % len(ring)] for i in range(1, count + 1)]
    return send_to, watch


def route_address(host: str, port: int) -> str:
    """The local address this host uses to reach ``host:port`` (no packet is sent); loopback,
    with a warning, where there is no route (peers elsewhere then never hear this node, and its
    lease is what finds it lost)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
        except OSError as exc:
            log.warning(
                "heartbeats: no route to %s:%d (%s); advertising 127.0.0.1 (pass --local-addr)",
                host,
                port,
                exc,
            )
            return "127.0.0.1"


def _resolve(address: tuple[str, int]) -> tuple[Any, ...]:
    """A socket address for ``sendto`` (a host name resolved once, not on every datagram)."""
    return tuple(socket.getaddrinfo(address[0], address[1], type=socket.SOCK_DGRAM)[0][4])


class PeerHeartbeats:
    """See the module docstring.

    Args:
        run_id: datagrams of another job (a port reused) are ignored.
        node: this node's name.
        advertise_host: the address peers send to (the port is chosen when the socket binds).
        on_silent: ``on_silent(node)``, called from this object's thread (must not block).
    """

    def __init__(
        self,
        *,
        run_id: str,
        node: str,
        advertise_host: str,
        on_silent: Callable[[str], None],
        interval_s: float = INTERVAL_S,
        silent_after_s: float = SILENT_AFTER_S,
        fanout: int = FANOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < interval_s < silent_after_s:
            raise ValueError(
                f"heartbeats: need 0 < interval_s ({interval_s}) < silent_after_s ({silent_after_s})"
            )
        if fanout < 1:
            raise ValueError(f"heartbeats: fanout must be at least 1, not {fanout}")
        self.node = node
        self.interval_s, self.silent_after_s, self.fanout = interval_s, silent_after_s, fanout
        self._clock = clock
        self._on_silent = on_silent
        self._payload = f"{run_id}\n{node}".encode()
        self._run_prefix = f"{run_id}\n".encode()
        family = socket.AF_INET6 if ":" in advertise_host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_DGRAM)
        self._socket.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        self._socket.setblocking(False)
        port = self._socket.getsockname()[1]
        self.address = (
            f"[{advertise_host}]:{port}"
            if family == socket.AF_INET6
            else f"{advertise_host}:{port}"
        )
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[Any, ...]] = {}
        self._lingering: dict[str, tuple[tuple[Any, ...], float]] = {}  # former targets, until when
        self._heard: dict[str, float] = {}
        self._reported: set[str] = set()
        self._known_since: dict[str, float] = {}
        self._warned_blocked = False
        self._closed = threading.Event()
        # Wakes the loop from its idle wait (no peers: nothing to send or judge) on set_peers/close.
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="peer-heartbeats", daemon=True)
        self._thread.start()

    def set_peers(self, peers: Mapping[str, str]) -> None:
        """The job's other live nodes and their heartbeat addresses (``host:port``); a node left
        out is no longer sent to or watched. Unreadable addresses are skipped with a warning."""
        parsed: dict[str, tuple[Any, ...]] = {}
        for name, address in peers.items():
            if name == self.node:
                continue
            try:
                parsed[name] = _resolve(parse_address(address))
            except (ValueError, OSError) as exc:
                log.warning("heartbeats: node %s: %s", name, exc)
        now = self._clock()
        with self._lock:
            sent_to, watched = ring_neighbours(list(self._peers), self.node, self.fanout)
            # Nodes this one stops sending to may still watch it until their own view changes:
            # they keep getting beats for one silence more.
            for name in sent_to:
                if name in parsed and name in self._peers:
                    self._lingering[name] = (self._peers[name], now + self.silent_after_s)
            self._peers = parsed
            _, watch = ring_neighbours(list(parsed), self.node, self.fanout)
            # A node watched from now on may not have sent here until its own view changed too:
            # its silence counts from now (a node never heard stays never heard).
            self._heard = {
                name: (now if name in watch and name not in watched else at)
                for name, at in self._heard.items()
                if name in parsed
            }
            self._reported &= set(parsed)
            # When each peer became known: a newcomer has had no time to send yet.
            self._known_since = {name: self._known_since.get(name, now) for name in parsed}
        self._wake()

    def still_silent(self, node: str) -> bool:
        """Whether ``node`` has not been heard for ``silent_after_s`` (a report is still true)."""
        with self._lock:
            last = self._heard.get(node)
        return last is None or self._clock() - last > self.silent_after_s

    def heard(self) -> dict[str, float]:
        """Node -> when it was last heard (this object's clock)."""
        with self._lock:
            return dict(self._heard)

    def close(self) -> None:
        self._closed.set()
        self._wake()
        self._thread.join(timeout=2)
        self._socket.close()
        self._wake_read.close()
        self._wake_write.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
            self._wake_write.send(b"\0")

    def _idle(self) -> bool:
        """No peer to send to, none lingering: the loop has nothing to do until set_peers."""
        with self._lock:
            return not self._peers and not self._lingering

    # -- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        next_beat = self._clock()
        while not self._closed.is_set():
            try:
                # Alone (a one-node job), no timer: a healthy step of such a job wakes nothing here.
                timeout = None if self._idle() else max(0.0, next_beat - self._clock())
                readable, _, _ = select.select([self._socket, self._wake_read], [], [], timeout)
                if self._wake_read in readable:
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        self._wake_read.recv(64)
                if self._socket in readable:
                    self._receive()
                now = self._clock()
                if now < next_beat:
                    continue
                late = now - next_beat > self.silent_after_s / 2  # this loop itself stalled
                next_beat = now + self.interval_s
                self._receive()  # what arrived while this loop was away counts before judging
                self._beat()
                if not late:
                    self._judge(self._clock())
            except OSError as exc:
                if self._closed.is_set():
                    return
                log.warning("heartbeats: %s", exc)
                self._closed.wait(self.interval_s)

    def _receive(self) -> None:
        now = self._clock()
        while True:
            try:
                data = self._socket.recv(_MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            if not data.startswith(self._run_prefix):
                continue
            sender = data[len(self._run_prefix) :].decode(errors="replace")
            with self._lock:
                if sender in self._peers:
                    self._heard[sender] = now
                    self._reported.discard(sender)

    def _beat(self) -> None:
        now = self._clock()
        with self._lock:
            send_to, _ = ring_neighbours(list(self._peers), self.node, self.fanout)
            targets = [self._peers[name] for name in send_to]
            self._lingering = {
                name: (address, until)
                for name, (address, until) in self._lingering.items()
                if until > now and name not in send_to
            }
            targets += [address for address, _ in self._lingering.values()]
        for target in targets:
            try:
                self._socket.sendto(self._payload, target)
            except (
                OSError
            ) as exc:  # unreachable now (a partition): the peer will notice the silence
                log.debug("heartbeats: sending to %s failed: %s", target, exc)

    def _judge(self, now: float) -> None:
        silent: list[str] = []
        with self._lock:
            _, watch = ring_neighbours(list(self._peers), self.node, self.fanout)
            for name in watch:
                last = self._heard.get(name)
                if (
                    last is not None
                    and now - last > self.silent_after_s
                    and name not in self._reported
                ):
                    self._reported.add(name)
                    silent.append(name)
            never = (
                watch
                and not any(name in self._heard for name in watch)
                and all(
                    now - self._known_since.get(name, now) > NEVER_HEARD_WARNING_S for name in watch
                )
            )
        if never and not self._warned_blocked:
            self._warned_blocked = True
            log.warning(
                "heartbeats: nothing heard from nodes %s in %.0f s (UDP blocked between nodes?); a lost "
                "node is noticed by its liveness lease instead",
                ", ".join(watch),
                NEVER_HEARD_WARNING_S,
            )
        for name in silent:
            log.warning("heartbeats: node %s silent for %.1f s", name, self.silent_after_s)
            try:
                self._on_silent(name)
            except Exception as exc:  # noqa: BLE001 - a report must not stop the heartbeats
                log.warning("heartbeats: reporting node %s failed: %s", name, exc)
