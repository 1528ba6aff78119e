"""A native etcd v3 rendezvous handler: leases for liveness, watches for wake-ups, fast close.

torch's dynamic rendezvous (``handler.py``) keeps the whole rendezvous in one key that every node
rewrites with heartbeats, polls it once a second, notices a dead node only when its heartbeat is
older than ``heartbeat_timeout``, and waits the ``last_call_timeout`` window (30 s) in *every*
elastic round. Recovering from a crashed worker thus costs half a minute. This handler keeps
torchrun's contract (same ``RendezvousHandler`` interface, same ranks-by-round semantics) and
changes how a round is reached:

* **Liveness through leases.** Each node holds an etcd lease (``lease_ttl``, default 10 s) kept
  alive by a background thread, and a key ``nodes/<node>`` attached to it. A node that dies loses
  its key when the lease expires; a node that leaves gracefully (SIGTERM, scale-down) revokes its
  lease on exit and disappears at once. No heartbeat writes to a shared key.
* **Wake-ups through watches.** Everything a waiting node needs lives under ``rdzv/``; a prefix
  watch wakes it on any change (a join, a close, a death), and ``num_nodes_waiting()`` -- called
  by the agent every monitor interval -- reads a cache that the same watch keeps current: zero
  etcd requests in steady state besides lease keep-alives.
* **Fast close.** A round that follows another closes as soon as every *live* member of the
  previous round has rejoined (and at least ``min_nodes`` are in). The last-call window applies
  only to the first round of a job, to gather nodes beyond the minimum. A newcomer opens a new
  round only while the job is below ``max_nodes``; otherwise it waits until a slot frees.

Keys under ``{key_prefix}/{run_id}/``::

    rdzv/state            framed JSON: round, status (open|complete|closed), participants, previous
    rdzv/nodes/<node>     a live node (attached to its lease); JSON {"addr": ..., "pid": ...}
    rdzv/rounds/<r>/<node> node joined round r (attached to its lease)
    store/...             the rendezvous store (EtcdV3Store), per round under a prefix
    job                   what the job runs (rendezvous.job_identity): another job is refused

Every state change is a compare-and-swap on ``rdzv/state``'s revision, so concurrent nodes agree
on one outcome; any node may close a round once the condition holds. While a node waits for the
minimum (or in the last call) it logs how many nodes have joined and how long is left, at WARNING
so that torchrun and ``elastic-trainer run`` show it by default.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from rendezvous.etcd_client import EtcdConnection, quiet_retries
from rendezvous.etcd_store import EtcdV3Store
from rendezvous.framing import frame_state, unframe_state
from rendezvous.job_identity import claim_run, current_job_identity
from rendezvous.settings import RendezvousSettings, parse_settings

log = logging.getLogger(__name__)

OPEN, COMPLETE, CLOSED = "open", "complete", "closed"


@dataclass(slots=True)
class RoundState:
    """The decoded ``rdzv/state`` key."""

    round: int
    status: str
    participants: list[str] = field(default_factory=list)
    previous: list[str] | None = None

    def encode(self) -> bytes:
        data = {"round": self.round, "status": self.status, "participants": self.participants,
                "previous": self.previous}
        return frame_state(json.dumps(data, sort_keys=True).encode())

    @classmethod
    def decode(cls, raw: bytes, key: str) -> RoundState:
        try:
            data = json.loads(unframe_state(raw, key=key))
            state = cls(int(data["round"]), str(data["status"]), list(data["participants"]), data["previous"])
        except RendezvousStateError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise RendezvousStateError(f"the rendezvous state at {key} is malformed: {exc}") from exc
        if state.status not in (OPEN, COMPLETE, CLOSED):
            raise RendezvousStateError(f"the rendezvous state at {key} has unknown status {state.status!r}")
        return state


@dataclass(slots=True)
class Snapshot:
    """One consistent read of everything under ``rdzv/``."""

    revision: int
    state: RoundState | None
    state_revision: int
    live: set[str]
    joined: dict[int, list[str]]  # round -> nodes in join (create revision) order
    leases: dict[str, int] = field(default_factory=dict)  # live node -> its lease id
    node_values: dict[str, bytes] = field(default_factory=dict)  # live node -> its key's value (NodeInfo)


def decide_close(
    snapshot: Snapshot, settings: RendezvousSettings, min_reached_for: float
) -> list[str] | None:
    """The participants of the open round if it may close now, else ``None``.

    Args:
        snapshot: the current view; its state must be ``open``.
        min_reached_for: seconds since this node first saw ``min_nodes`` joined (0 if not yet).
    """
    state = snapshot.state
    if state is None or state.status != OPEN:
        return None
    joined = [n for n in snapshot.joined.get(state.round, []) if n in snapshot.live]
    if len(joined) < settings.min_nodes:
        return None
    ordered = order_participants(joined, state.previous)[: settings.max_nodes]
    if len(joined) >= settings.max_nodes:
        return ordered
    if state.previous is not None:
        missing = [n for n in state.previous if n in snapshot.live and n not in joined]
        return ordered if not missing else None
    return ordered if min_reached_for >= settings.last_call_timeout else None


def order_participants(joined: list[str], previous: list[str] | None) -> list[str]:
    """Previous members keep their relative order (rank 0 stays rank 0); newcomers follow."""
    before = [n for n in (previous or []) if n in joined]
    return before + [n for n in joined if n not in before]


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node stores under its ``rdzv/nodes/<node>`` key: where it runs."""

    addr: str
    pid: int

    def encode(self) -> bytes:
        return json.dumps({"addr": self.addr, "pid": self.pid}).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> NodeInfo | None:
        """The stored info, or ``None`` if ``raw`` is missing or not a node value."""
        if not raw:
            return None
        try:
            data = json.loads(raw)
            addr, pid = data["addr"], data["pid"]
        except (ValueError, TypeError, KeyError, RecursionError):  # JSON/UTF-8 errors: ValueError
            return None
        if not isinstance(addr, str) or not isinstance(pid, int) or isinstance(pid, bool):
            return None
        return cls(addr, pid)


class RunKeys:
    """The etcd keys of one run's lease rendezvous."""

    def __init__(self, key_prefix: str, run_id: str) -> None:
        self.key_prefix, self.run_id = key_prefix, run_id
        base = f"{key_prefix.rstrip('/')}/{run_id}"
        self.rdzv = f"{base}/rdzv/"
        self.state = f"{base}/rdzv/state"
        self.nodes = f"{base}/rdzv/nodes/"
        self.rounds = f"{base}/rdzv/rounds/"
        self.store = f"{base}/store"
        self.job = f"{base}/job"

    @classmethod
    def from_settings(cls, settings: RendezvousSettings) -> RunKeys:
        """The keys of the settings' run under their ``key_prefix``."""
        return cls(settings.key_prefix, settings.run_id)

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> RunKeys:
        """The keys of ``params.run_id`` under the ``key_prefix`` rdzv-conf key (default
        :data:`rendezvous.settings.DEFAULT_KEY_PREFIX`): the handler's and ``status``'s.

        Raises:
            RendezvousConfigError: a malformed parameter (see :func:`parse_settings`)."""
        return cls.from_settings(parse_settings(params))

    def node(self, node: str) -> str:
        return self.nodes + node

    def joined(self, round_: int, node: str) -> str:
        return f"{self.rounds}{round_}/{node}"


def read_snapshot(connection: EtcdConnection, keys: RunKeys) -> Snapshot:
    """Everything under ``rdzv/`` in one request (also used by ``elastic-trainer status``)."""
    response = connection.call(lambda client: client.get_prefix_response(keys.rdzv), what="a rendezvous read")
    state, state_revision, live, leases, values = None, 0, set(), {}, {}
    joined: dict[int, list[tuple[int, str]]] = {}
    for kv in response.kvs:
        key = kv.key.decode()
        if key == keys.state:
            state, state_revision = RoundState.decode(kv.value, key), kv.mod_revision
        elif key.startswith(keys.nodes):
            node = key[len(keys.nodes):]
            live.add(node)
            leases[node] = int(kv.lease)
            values[node] = bytes(kv.value)
        elif key.startswith(keys.rounds):
            round_text, _, node = key[len(keys.rounds):].partition("/")
            joined.setdefault(int(round_text), []).append((kv.create_revision, node))
    ordered = {r: [n for _, n in sorted(items)] for r, items in joined.items()}
    return Snapshot(response.header.revision, state, state_revision, live, ordered, leases, values)


def _range_end(prefix: str) -> bytes:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw)


def _lease_not_found(exc: BaseException) -> bool:
    """etcd answered NOT_FOUND "requested lease not found" (the lease expired)."""
    return "lease not found" in str(exc)


def _refresh(lease_id: int) -> Callable[[Any], int]:
    return lambda client: int(list(client.refresh_lease(lease_id))[0].TTL)


def _put(key: str, value: bytes, lease: int) -> Callable[[Any], Any]:
    return lambda client: client.put(key, value, lease=lease)


class _NodeLease:
    """This node's lease and liveness key, kept alive by a daemon thread; revoked on exit."""

    def __init__(self, connection: EtcdConnection, key: str, value: bytes, ttl: int) -> None:
        self._connection, self._key, self._value, self._ttl = connection, key, value, ttl
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def lease_id(self) -> int:
        with self._lock:
            if self._lease_id is None:
                lease = self._connection.call(lambda c: c.lease(self._ttl), what="a lease grant")
                self._lease_id = int(lease.id)
                self._connection.call(
                    lambda c: c.put(self._key, self._value, lease=self._lease_id), what="a node registration"
                )
            if self._thread is None:
                self._thread = threading.Thread(target=self._keep_alive, name="etcd-v3-lease", daemon=True)
                self._thread.start()
            return self._lease_id

    def invalidate(self, lease_id: int) -> None:
        """Forget ``lease_id`` (etcd no longer has it); the next :meth:`lease_id` grants anew."""
        with self._lock:
            if self._lease_id == lease_id:
                self._lease_id = None

    def _keep_alive(self) -> None:
        interval = max(self._ttl / 3.0, 0.5)
        while not self._stop.wait(interval):
            lease_id = self._lease_id
            if lease_id is None:
                continue
            try:
                ttl = self._connection.call(_refresh(lease_id), what="a lease keep-alive")
            except Exception as exc:  # etcd unreachable for retry_timeout: keep trying
                log.warning("etcd-v3: lease keep-alive failed: %s", exc)
                continue
            if ttl <= 0:  # expired while we were cut off: re-register under a new lease
                log.warning("etcd-v3: this node's lease expired; registering again")
                with self._lock:
                    self._lease_id = None
                try:
                    self.lease_id()
                except Exception as exc:
                    log.warning("etcd-v3: re-registration failed: %s", exc)

    def revoke(self) -> None:
        """Leave: stop keeping alive and revoke, so peers see this node gone immediately."""
        self._stop.set()
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            try:
                # Short, quiet budget: this also runs at interpreter exit, where etcd may be gone
                # (the lease then simply expires).
                with quiet_retries():
                    self._connection.call(
                        lambda c: c.revoke_lease(lease_id), what="a lease revocation", retry_timeout=2.0
                    )
            except Exception as exc:  # peers will see the lease expire instead
                log.info("etcd-v3: could not revoke this node's lease (it will expire): %s", exc)


class _PrefixWatch:
    """A self-healing watch on ``rdzv/``: bumps a version and wakes waiters on every event."""

    def __init__(self, connection: EtcdConnection, prefix: str, on_event: Callable[[Any], None]) -> None:
        self._connection, self._prefix, self._on_event = connection, prefix, on_event
        self._cond = threading.Condition()
        self.version = 0
        self._watch: tuple[Any, int] | None = None
        self._broken = True

    def ensure(self, start_revision: int) -> None:
        """(Re)create the watch from ``start_revision`` if it is not running."""
        if not self._broken:
            return
        client = self._connection.client()
        watch_id = client.add_watch_prefix_callback(
            self._prefix, self._callback, start_revision=start_revision
        )
        self._watch, self._broken = (client, watch_id), False

    def _callback(self, response: Any) -> None:
        if isinstance(response, Exception):
            self._broken = True
        else:
            for event in getattr(response, "events", ()):
                self._on_event(event)
        with self._cond:
            self.version += 1
            self._cond.notify_all()

    def wait(self, seen_version: int, timeout: float) -> None:
        """Wait until an event newer than ``seen_version`` or ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != seen_version, timeout=max(timeout, 0.0))

    def cancel(self) -> None:
        watch, self._watch = self._watch, None
        self._broken = True
        if watch is not None:
            try:
                watch[0].cancel_watch(watch[1])
            except Exception as exc:
                log.debug("cancelling the rendezvous watch failed: %s", exc)


class LeaseRendezvousHandler(RendezvousHandler):
    """The ``etcd-v3`` handler: see the module docstring."""

    _SAFETY_RECHECK_S = 2.0
    _PROGRESS_LOG_S = 5.0  # while waiting for nodes: a line this often

    def __init__(self, connection: EtcdConnection, settings: RendezvousSettings) -> None:
        self._connection = connection
        self._settings = settings
        self._keys = RunKeys.from_settings(settings)
        self._addr = settings.local_addr or socket.getfqdn()
        self.node_id = f"{self._addr}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        node_info = NodeInfo(self._addr, os.getpid()).encode()
        self._lease = _NodeLease(connection, self._keys.node(self.node_id), node_info, settings.lease_ttl)
        self._store = EtcdV3Store(connection, self._keys.store, ttl=settings.ttl)
        self._watch = _PrefixWatch(connection, self._keys.rdzv, self._on_event)
        self._round = -1  # the round this node last completed
        self._latest_round = -1  # the highest round number seen (cache fed by the watch)
        self._members: frozenset[str] = frozenset()  # participants of this node's round
        self._member_lost = False  # a participant's node key vanished (death, leave, partition)
        self._closed = False  # the watch saw the run closed (a finished job)
        self._tcp_store: dist.TCPStore | None = None
        # A node whose launcher exits (SIGTERM on scale-down, an error) leaves at once instead
        # of after its lease expires: weakref.finalize also runs at interpreter exit.
        self._finalizer = weakref.finalize(self, _NodeLease.revoke, self._lease)

    # -- RendezvousHandler ------------------------------------------------------------------------

    def get_backend(self) -> str:
        """See base class."""
        return "etcd-v3"

    @property
    def use_agent_store(self) -> bool:
        """See base class."""
        return True

    def get_run_id(self) -> str:
        """See base class."""
        return self._settings.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        deadline = time.monotonic() + self._settings.join_timeout
        self._lease.lease_id()
        participants, round_ = self._join_round(deadline)
        rank, world_size = participants.index(self.node_id), len(participants)
        self._round = round_
        self._members, self._member_lost = frozenset(participants), False
        store = dist.PrefixStore(f"torch.rendezvous.{self._settings.run_id}.{round_}", self._store)
        # A fresh TCPStore for the workers every round (see handler.py for why it must be fresh).
        server_port = None
        if rank == 0:
            self._tcp_store = dist.TCPStore(host_name=self._addr, port=0, is_master=True, multi_tenant=True)
            server_port = self._tcp_store.port
        bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self._addr, server_port=server_port)
        log.info("etcd-v3: node %s is rank %d of %d in round %d of run %s",
                 self.node_id, rank, world_size, round_, self._settings.run_id)
        return RendezvousInfo(store, rank, world_size, bootstrap)

    def is_closed(self) -> bool:
        """See base class."""
        snapshot = self._read()
        return snapshot.state is not None and snapshot.state.status == CLOSED

    def set_closed(self) -> None:
        """See base class."""
        while True:
            snapshot = self._read()
            state = snapshot.state or RoundState(0, OPEN)
            if state.status == CLOSED:
                return
            closed = RoundState(state.round, CLOSED, state.participants, state.previous)
            if self._swap(snapshot.state_revision, closed):
                return

    def num_nodes_waiting(self) -> int:
        """See base class. Served from the watch's cache: no etcd request.

        Non-zero (so the agent restarts its workers and rejoins) when a newer round is open, or
        when a member of this node's round lost its lease: a frozen or partitioned peer gives the
        workers no error -- they would block in a collective until the process-group timeout --
        but its lease expires after ``lease_ttl``. Zero once the run is closed (a finished job's
        nodes leave one after another; that is no reason to restart).
        """
        if self._watch._broken:  # the watch died (etcd restart): one read refreshes the cache
            try:
                snapshot = self._read()
                self._watch.ensure(snapshot.revision + 1)
                if snapshot.state is not None:
                    self._closed = snapshot.state.status == CLOSED
                if self._members - snapshot.live:
                    self._member_lost = True
            except Exception as exc:
                log.warning("etcd-v3: cannot refresh the rendezvous view: %s", exc)
                return 0
        if self._closed or self._round < 0:
            return 0
        return 1 if self._latest_round > self._round or self._member_lost else 0

    def shutdown(self) -> bool:
        """See base class. Closes the rendezvous for everyone (torch semantics) and leaves."""
        try:
            self.set_closed()
            return True
        except Exception as exc:
            log.warning("etcd-v3: could not close the rendezvous: %s", exc)
            return False
        finally:
            self._watch.cancel()
            self._finalizer()

    # -- the protocol -----------------------------------------------------------------------------

    def _on_event(self, event: Any) -> None:
        key = event.key.decode() if isinstance(event.key, bytes) else str(event.key)
        if key.startswith(self._keys.nodes):
            node = key[len(self._keys.nodes):]
            deleted = isinstance(event, self._connection.etcd3.events.DeleteEvent)
            if deleted and node in self._members and node != self.node_id:
                if self._closed:  # a finished job's nodes leave one after another: no news
                    log.info("etcd-v3: node %s left the closed run", node)
                    return
                log.warning("etcd-v3: node %s of round %d is gone (lease expired or revoked)", node, self._round)
                self._member_lost = True
            return
        if key != self._keys.state or not getattr(event, "value", None):
            return
        try:
            state = RoundState.decode(event.value, key)
        except RendezvousStateError:
            return
        self._latest_round = max(self._latest_round, state.round)
        self._closed = state.status == CLOSED

    def _read(self) -> Snapshot:
        snapshot = read_snapshot(self._connection, self._keys)
        if snapshot.state is not None:
            self._latest_round = max(self._latest_round, snapshot.state.round)
        return snapshot

    def _swap(self, expected_revision: int, new: RoundState, extra: list[Any] | None = None) -> bool:
        txn = self._connection.etcd3.transactions
        key = self._keys.state
        compare = [txn.Mod(key) == expected_revision] if expected_revision else [txn.Create(key) == 0]
        succeeded, _ = self._connection.call(
            lambda c: c.transaction(compare=compare, success=[txn.Put(key, new.encode()), *(extra or [])], failure=[]),
            what="a rendezvous state change",
        )
        return bool(succeeded)

    def _join_round(self, deadline: float) -> tuple[list[str], int]:
        """Join (or open) a round and wait until it closes with this node in it."""
        settings = self._settings
        joined_round: int | None = None
        min_reached_at: float | None = None
        next_progress_at = time.monotonic() + self._PROGRESS_LOG_S
        while True:
            seen = self._watch.version
            snapshot = self._read()
            self._watch.ensure(snapshot.revision + 1)
            state = snapshot.state
            now = time.monotonic()
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"etcd-v3: no rendezvous of run {settings.run_id!r} within {settings.join_timeout:g}s: "
                    f"{waiting_summary(snapshot, settings, self.node_id)}"
                )
            if state is None:
                self._swap(0, RoundState(0, OPEN))
                continue
            if state.status == CLOSED:
                raise RendezvousClosedError(f"the rendezvous of run {settings.run_id!r} is closed")
            if state.status == COMPLETE:
                if joined_round == state.round and self.node_id in state.participants:
                    return state.participants, state.round
                if state.round > self._round and self.node_id in state.participants:
                    return state.participants, state.round
                live_members = [n for n in state.participants if n in snapshot.live]
                if len(live_members) < settings.max_nodes or self.node_id in state.participants:
                    # Open the next round; the running members see it and rejoin.
                    self._swap(snapshot.state_revision, RoundState(state.round + 1, OPEN, [], state.participants))
                    continue
                # The job is full: wait as a spare until a round opens.
                self._watch.wait(seen, min(self._SAFETY_RECHECK_S, deadline - now))
                continue
            # status OPEN
            if joined_round != state.round:
                join_key = self._keys.joined(state.round, self.node_id)
                lease = self._lease.lease_id()
                try:
                    self._connection.call(_put(join_key, b"", lease), what="a rendezvous join")
                except RendezvousConnectionError as exc:
                    if not _lease_not_found(exc):
                        raise
                    # Cut off longer than lease_ttl (a partition): our lease expired. Register
                    # again under a new lease and retry the join.
                    log.warning("etcd-v3: this node's lease expired; registering again")
                    self._lease.invalidate(lease)
                    continue
                joined_round, min_reached_at = state.round, None
                continue
            live_joined = [n for n in snapshot.joined.get(state.round, []) if n in snapshot.live]
            if len(live_joined) >= settings.min_nodes and min_reached_at is None:
                min_reached_at = now
            waited = 0.0 if min_reached_at is None else now - min_reached_at
            participants = decide_close(snapshot, settings, waited)
            if participants is not None:
                txn = self._connection.etcd3.transactions
                stale = [txn.Delete(f"{self._keys.rounds}{r}/", _range_end(f"{self._keys.rounds}{r}/"))
                         for r in snapshot.joined if r < state.round]
                closed = RoundState(state.round, COMPLETE, participants, state.previous)
                self._swap(snapshot.state_revision, closed, stale)
                continue
            in_last_call = min_reached_at is not None and state.previous is None
            timeout = self._SAFETY_RECHECK_S
            if min_reached_at is None or in_last_call:  # waiting for nodes: say so now and then
                if now >= next_progress_at:
                    self._log_progress(len(live_joined), deadline - now, settings.last_call_timeout - waited)
                    next_progress_at = now + self._PROGRESS_LOG_S
                timeout = min(timeout, next_progress_at - now)
            if in_last_call:
                timeout = min(timeout, settings.last_call_timeout - waited)
            self._watch.wait(seen, min(timeout, deadline - now))

    def _log_progress(self, joined: int, left: float, last_call_left: float) -> None:
        settings = self._settings
        if joined < settings.min_nodes:
            log.warning("etcd-v3: run %s: waiting for nodes: %d of min %d joined, %.0f s left",
                        settings.run_id, joined, settings.min_nodes, max(left, 0.0))
        else:
            log.warning("etcd-v3: run %s: waiting for more nodes: %d joined (min %d, max %d), "
                        "last call ends in %.0f s", settings.run_id, joined, settings.min_nodes,
                        settings.max_nodes, max(last_call_left, 0.0))


def waiting_summary(snapshot: Snapshot, settings: RendezvousSettings, node_id: str) -> str:
    """Why a round has not closed for ``node_id``, for people (the join-timeout error)."""
    state = snapshot.state
    if state is None:
        return "no round was open"
    if state.status == COMPLETE:
        live = [n for n in state.participants if n in snapshot.live]
        return (f"the job is full ({len(live)} of max {settings.max_nodes} nodes run it); "
                "this node waited as a spare")
    if state.status != OPEN:
        return f"the rendezvous is {state.status}"
    joined = [n for n in snapshot.joined.get(state.round, []) if n in snapshot.live]
    if len(joined) < settings.min_nodes:
        return f"{len(joined)} of min {settings.min_nodes} nodes had joined round {state.round}"
    missing = [n for n in state.previous or [] if n in snapshot.live and n not in joined]
    if missing:
        return (f"{len(joined)} nodes had joined round {state.round}; {len(missing)} live member(s) "
                f"of the previous round had not rejoined: {', '.join(missing)}")
    return f"{len(joined)} nodes had joined round {state.round} (min {settings.min_nodes}), still in the last call"


def create_lease_handler(settings: RendezvousSettings) -> LeaseRendezvousHandler:
    """Build the handler from parsed settings (see :func:`rendezvous.handler.create_handler`).

    Raises:
        RendezvousConfigError: no endpoint (before any connection is made).
        RendezvousConnectionError: etcd cannot be reached.
        RunIdInUseError: another job holds the run id (this node has written nothing).
    """
    connection = EtcdConnection(settings.client_config())
    try:
        connection.check()
        identity = current_job_identity()
        if identity is not None:  # no lease: the record lives as long as the round state
            claim_run(connection, RunKeys.from_settings(settings).job, identity, run_id=settings.run_id)
        return LeaseRendezvousHandler(connection, settings)
    except BaseException:
        connection.close()
        raise
