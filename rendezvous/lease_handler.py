"""A native etcd v3 rendezvous handler: leases for liveness, watches for wake-ups, fast close.

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=etcd-0:2379,etcd-1:2379,etcd-2:2379 \\
             --rdzv-id=job-42 --nnodes=1:1024 --nproc-per-node=8 train.py

torch's own dynamic rendezvous keeps the whole rendezvous in one key that every node
rewrites with heartbeats, polls it once a second, notices a dead node only when its heartbeat is
older than ``heartbeat_timeout``, and waits the ``last_call_timeout`` window (30 s) in *every*
elastic round. This handler keeps torchrun's contract (same ``RendezvousHandler`` interface, same
ranks-by-round semantics) and changes how a round is reached:

* **Liveness through leases.** Each node holds an etcd lease (``lease_ttl``, default 10 s), kept
  alive over one streaming keep-alive per process (:mod:`rendezvous.lease_keeper`), and a key
  ``nodes/<node>`` attached to it. A node that dies loses its key when the lease expires; a node
  that leaves (SIGTERM, scale-down, a normal exit) revokes its lease and disappears at once.
* **One coordinator decides.** The node holding ``state/coordinator``
  (:mod:`rendezvous.coordinator`) watches every node and join key and closes a round as soon as
  the rule holds, writing ranks in shards; if it dies its key goes with its lease, and another
  node claims the key after a short random delay.
* **Each node watches only what concerns it**: the three ``state*`` keys and its own rank shard
  (:mod:`rendezvous.round_state` lists the keys). Joining a round is one write; being released
  is two watch events; ``num_nodes_waiting()`` -- called by the agent every monitor interval --
  reads a cache the watch keeps current: no etcd request in steady state besides keep-alives.
* **Fast close.** A round that follows another closes as soon as every *live* member of the
  previous round has rejoined (and at least ``min_nodes`` are in). The last-call window applies
  only to a job's first round, to gather nodes beyond the minimum. A newcomer opens a new round
  only while the job is below ``max_nodes``; otherwise it waits as a spare until a slot frees.

A round therefore costs each node a constant number of etcd requests and events, whatever the
size of the job; ``docs/design/rendezvous-scale.md`` explains the design and
``benchmarks/RESULTS.md`` has the measurements (up to 4,096 simulated nodes). Every state change is a
compare-and-swap on ``state``'s revision, so concurrent writers agree on one outcome. While a
node waits for the minimum (or in the last call) it logs how many nodes have joined and how long
is left, at WARNING so that torchrun and ``elastic-trainer run`` show it by default.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from rendezvous import etcd_ops, jitter
from rendezvous.coordinator import RoundCoordinator
from rendezvous.etcd_client import EtcdConnection, quiet_retries
from rendezvous.etcd_store import EtcdV3Store
from rendezvous.job_identity import claim_run, current_job_identity
from rendezvous.lease_keeper import LeaseKeeper
from rendezvous.round_state import (
    CLOSED,
    COMPLETE,
    OPEN,
    MasterInfo,
    NodeInfo,
    RoundState,
    RunKeys,
    Snapshot,
    close_ready,
    decide_close,
    decode_shard,
    order_participants,
    read_snapshot,
    shard_count,
    shard_of,
    waiting_summary,
)
from rendezvous.scheduler import Scheduler
from rendezvous.settings import RendezvousSettings
from rendezvous.watch_hub import HubWatch, WatchHub

__all__ = [
    "CLOSED",
    "COMPLETE",
    "OPEN",
    "LeaseRendezvousHandler",
    "MasterInfo",
    "NodeInfo",
    "RoundState",
    "RunKeys",
    "Snapshot",
    "close_ready",
    "create_lease_handler",
    "decide_close",
    "order_participants",
    "read_snapshot",
    "waiting_summary",
]

log = logging.getLogger(__name__)

_SPREAD_S_PER_NODE = 0.001
"""A node opens a job's first round or claims a vacant coordinator key after a random delay of up
to this much per node of ``max_nodes`` (at most ``lease_ttl``), and only if no other node has
done it by then: ten thousand nodes send a handful of such writes, not ten thousand."""


def round_deadline(settings: RendezvousSettings) -> float:
    """The gRPC deadline of one request on a round's path: ``lease_ttl / 4`` (at least 2 s, at
    most ``read_timeout``).

    etcd holds a write that a follower forwarded to a leader that then died until its own request
    timeout (5 s plus two election timeouts) before it answers "request timed out"; a shorter
    deadline lets the attempt fail over to a live member instead, after at most this long.
    """
    return min(settings.read_timeout, max(2.0, settings.lease_ttl / 4))


def _lease_not_found(exc: BaseException) -> bool:
    """etcd answered NOT_FOUND "requested lease not found" (the lease expired)."""
    return "lease not found" in str(exc)


class _NodeLease:
    """This node's lease and liveness key, kept alive by the connection's keeper; revoked on exit."""

    def __init__(self, connection: EtcdConnection, key: str, value: bytes, ttl: int) -> None:
        self._connection, self._key, self._value, self._ttl = connection, key, value, ttl
        self._keeper = LeaseKeeper.of(connection)
        self._scheduler = Scheduler.of(connection)
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._revoked = False

    def lease_id(self) -> int:
        """The lease in use, granted (and this node registered) if none is.

        Raises:
            RendezvousClosedError: this node left (:meth:`revoke`): it never registers again, or
                a thread still inside ``next_rendezvous`` would bring back a node that peers
                then wait for.
        """
        with self._lock:
            if self._revoked:
                raise RendezvousClosedError("etcd-v3: this node left the run")
            if self._lease_id is None:
                lease = self._connection.call(lambda c: c.lease(self._ttl), what="a lease grant")
                lease_id = int(lease.id)
                self._connection.call(
                    lambda c: c.put(self._key, self._value, lease=lease_id),
                    what="a node registration",
                )
                self._lease_id = lease_id
                self._keeper.keep(lease_id, self._ttl, self._expired)
            return self._lease_id

    @property
    def revoked(self) -> bool:
        """This node left the run."""
        return self._revoked

    def current(self) -> int | None:
        """The lease in use, or ``None`` if none is granted now."""
        return self._lease_id

    def invalidate(self, lease_id: int) -> None:
        """Forget ``lease_id`` (etcd no longer has it); the next :meth:`lease_id` grants anew."""
        with self._lock:
            if self._lease_id == lease_id:
                self._lease_id = None
        self._keeper.forget(lease_id)

    def _expired(self, lease_id: int) -> None:
        """The keeper learnt that etcd dropped the lease (this node was cut off): register again."""
        with self._lock:
            if self._lease_id != lease_id or self._revoked:
                return
            self._lease_id = None
        log.warning("etcd-v3: this node's lease expired; registering again")
        self._scheduler.call_later(0.0, self._register_again)

    def _register_again(self) -> None:
        if self._revoked:
            return
        try:
            self.lease_id()
        except Exception as exc:
            log.warning("etcd-v3: re-registration failed (%s); retrying in 1 s", exc)
            self._scheduler.call_later(1.0, self._register_again)

    def revoke(self) -> None:
        """Leave: stop keeping alive and revoke, so peers see this node gone immediately."""
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
            self._revoked = True
        if lease_id is None:
            return
        self._keeper.forget(lease_id)
        try:
            # Short, quiet budget: this also runs at interpreter exit, where etcd may be gone
            # (the lease then simply expires).
            with quiet_retries():
                self._connection.call(
                    lambda c: c.revoke_lease(lease_id), what="a lease revocation", retry_timeout=2.0
                )
        except Exception as exc:  # peers will see the lease expire instead
            log.info("etcd-v3: could not revoke this node's lease (it will expire): %s", exc)


class _RoundWatch:
    """This node's watches: ``rdzv/state*`` and its rank shard. Bumps a version and wakes waiters
    on every event; reports itself broken when etcd can no longer resume it (compaction)."""

    def __init__(
        self, hub: WatchHub, prefix: str, shard_key: str, on_event: Callable[[Any], None]
    ) -> None:
        self._hub, self._prefix, self._shard_key = hub, prefix, shard_key
        self._on_event = on_event  # looked up per event: tests wrap it
        self._cond = threading.Condition()
        self.version = 0
        self._watches: list[HubWatch] = []
        self._broken = True

    def ensure(self, start_revision: int) -> None:
        """(Re)create the watches from ``start_revision`` if they are not running."""
        if not self._broken:
            return
        for watch in self._watches:
            watch.cancel()
        self._watches = [
            self._hub.watch(
                self._prefix,
                prefix=True,
                start_revision=start_revision,
                on_events=self._deliver,
                on_lost=self._lost,
            ),
            self._hub.watch(
                self._shard_key,
                start_revision=start_revision,
                on_events=self._deliver,
                on_lost=self._lost,
            ),
        ]
        self._broken = False

    def _deliver(self, events: list[Any]) -> None:
        for event in events:
            self._on_event(event)
        with self._cond:
            self.version += 1
            self._cond.notify_all()

    def _lost(self, reason: str) -> None:
        log.info("etcd-v3: the rendezvous watch was lost (%s); reading again", reason)
        self._broken = True
        with self._cond:
            self.version += 1
            self._cond.notify_all()

    def wait(self, seen_version: int, timeout: float) -> None:
        """Wait until an event newer than ``seen_version`` or ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != seen_version, timeout=max(timeout, 0.0))

    def cancel(self) -> None:
        watches, self._watches = self._watches, []
        self._broken = True
        for watch in watches:
            watch.cancel()
        with self._cond:  # a thread waiting in next_rendezvous looks again (and sees it left)
            self.version += 1
            self._cond.notify_all()


@dataclass(slots=True)
class _JoinWait:
    """What one :meth:`LeaseRendezvousHandler._join_round` has seen and plans (monotonic times)."""

    next_progress_at: float
    """When to log again how many nodes have joined."""
    recheck_at: float
    """When to read the state if no event comes by then."""
    joined: tuple[int, int] | None = None
    """The round and lease of this node's join key."""
    min_seen_at: float | None = None
    """When the joined round first had ``min_nodes``."""
    creation_due: float | None = None
    """When to create the state key, should no other node have done it."""


class _CoordinatorSlot:
    """The coordinator this node runs, if any (shared with the finalizer)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.coordinator: RoundCoordinator | None = None
        self.left = False

    def stop(self) -> None:
        with self.lock:
            self.left = True
            coordinator, self.coordinator = self.coordinator, None
        if coordinator is not None:
            coordinator.stop(wait=2.0)


def _leave(
    lease: _NodeLease, watch: _RoundWatch, slot: _CoordinatorSlot, owned: EtcdConnection | None
) -> None:
    slot.stop()
    lease.revoke()  # first: a joining thread woken by the cancel must find the node gone
    watch.cancel()
    if owned is not None:  # its keep-alive, watch and task threads end with it
        owned.close()


class LeaseRendezvousHandler(RendezvousHandler):
    """The ``etcd-v3`` handler: see the module docstring.

    Many handlers may share one :class:`EtcdConnection` (a benchmark simulating nodes); each keeps
    its own lease, keys and watches, exactly as one per process would. With ``owns_connection``
    (:func:`create_lease_handler`), leaving (:meth:`shutdown`, :meth:`leave`, garbage collection)
    also closes the connection, so no thread of it outlives the handler.
    """

    _SAFETY_RECHECK_S = (
        300.0  # no event for this long while waiting: read the state (a stalled stream?)
    )
    _PROGRESS_LOG_S = 5.0  # while waiting for nodes: a line this often

    def __init__(
        self,
        connection: EtcdConnection,
        settings: RendezvousSettings,
        *,
        owns_connection: bool = False,
    ) -> None:
        self._connection = connection
        self._settings = settings
        self._keys = RunKeys.from_settings(settings)
        self._addr = settings.local_addr or socket.getfqdn()
        self.node_id = f"{self._addr}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        node_info = NodeInfo(self._addr, os.getpid()).encode()
        self._lease = _NodeLease(
            connection, self._keys.node(self.node_id), node_info, settings.lease_ttl
        )
        self._store = EtcdV3Store(connection, self._keys.store, ttl=settings.ttl)
        self._scheduler = Scheduler.of(connection)
        self._deadline = round_deadline(settings)
        self._shards = shard_count(settings.max_nodes)
        self._shard_key = self._keys.shard(shard_of(self.node_id, self._shards))
        self._watch = _RoundWatch(
            WatchHub.of(connection), self._keys.state, self._shard_key, self._on_event
        )
        # The cache the watch keeps (written on the watch thread, read anywhere).
        self._state: tuple[RoundState | None, int] = (None, 0)  # the state and its mod revision
        self._coordinator_id: str | None = None
        self._master: MasterInfo | None = None
        self._shard: tuple[int, dict[str, int]] | None = None  # (round, ranks) of this node's shard
        self._round = -1  # the round this node last completed
        self._latest_round = -1  # the highest round number seen
        self._closed = False  # the run is closed (a finished job)
        self._slot = _CoordinatorSlot()
        self._claim_pending = False
        self._tcp_lock = threading.Lock()
        self._tcp_store: dist.TCPStore | None = None
        self._tcp_store_round = -1
        self._wait_marks: dict[tuple[int, str], float] = {}
        # A node whose launcher exits (SIGTERM on scale-down, an error) leaves at once instead
        # of after its lease expires: weakref.finalize also runs at interpreter exit.
        self._finalizer = weakref.finalize(
            self,
            _leave,
            self._lease,
            self._watch,
            self._slot,
            connection if owns_connection else None,
        )

    @property
    def connection(self) -> EtcdConnection:
        """The etcd connection of this handler. Others in the process may use it too (the
        in-place launcher's liveness lease and watches ride on its keep-alive and watch streams);
        a handler made with ``owns_connection`` closes it when it leaves."""
        return self._connection

    @property
    def settings(self) -> RendezvousSettings:
        """The settings this handler was made with."""
        return self._settings

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
        rank, world_size, round_, master = self._join_round(deadline)
        self._round = round_
        store = dist.PrefixStore(f"torch.rendezvous.{self._settings.run_id}.{round_}", self._store)
        # A fresh TCPStore for the workers every round, hosted by rank 0, whose address came with
        # the round: workers assume a new store per attempt and add no per-attempt prefix
        # (torch.distributed.rendezvous._create_c10d_store), so in a reused one the new workers
        # would meet the keys the dead ones left (gloo rank addresses) and block in connectFullMesh.
        bootstrap = RendezvousStoreInfo(master.addr, master.port)
        log.info(
            "etcd-v3: node %s is rank %d of %d in round %d of run %s",
            self.node_id,
            rank,
            world_size,
            round_,
            self._settings.run_id,
        )
        return RendezvousInfo(store, rank, world_size, bootstrap)

    def is_closed(self) -> bool:
        """See base class."""
        state, _ = self._read_state()
        return state is not None and state.status == CLOSED

    def set_closed(self) -> None:
        """See base class."""
        conn, key = self._connection, self._keys.state
        while True:
            state, revision = self._read_state()
            state = state or RoundState(0, OPEN)
            if state.status == CLOSED:
                return
            closed = RoundState(
                state.round, CLOSED, world_size=state.world_size, shards=state.shards
            )
            compare = (
                etcd_ops.mod_is(conn, key, revision) if revision else etcd_ops.absent(conn, key)
            )
            result = etcd_ops.transaction(
                conn,
                [compare],
                [etcd_ops.put(conn, key, closed.encode())],
                what="a rendezvous state change",
            )
            if result.succeeded:
                return

    def num_nodes_waiting(self) -> int:
        """See base class. Served from the watch's cache: no etcd request.

        Non-zero (so the agent restarts its workers and rejoins) when a newer round is open: a
        node opened it to join, a node restarted, or the coordinator saw a member of this round
        lose its lease (a frozen or partitioned peer gives the workers no error -- they would
        block in a collective until the process-group timeout -- but its lease expires after
        ``lease_ttl``). Zero once the run is closed (a finished job's nodes leave one after
        another; that is no reason to restart).
        """
        if self._watch._broken:  # the watch could not be resumed: one read refreshes the cache
            try:
                self._sync()
            except Exception as exc:
                log.warning("etcd-v3: cannot refresh the rendezvous view: %s", exc)
                return 0
        if self._closed or self._round < 0:
            return 0
        return 1 if self._latest_round > self._round else 0

    def shutdown(self) -> bool:
        """See base class. Closes the rendezvous for everyone (torch semantics) and leaves."""
        try:
            self.set_closed()
            return True
        except Exception as exc:
            log.warning("etcd-v3: could not close the rendezvous: %s", exc)
            return False
        finally:
            self._finalizer()

    def leave(self) -> None:
        """Leave the run without closing it (what a node does when its launcher exits)."""
        self._finalizer()

    # -- the cache --------------------------------------------------------------------------------

    def _on_event(self, event: Any) -> None:
        key = event.key.decode() if isinstance(event.key, bytes) else str(event.key)
        deleted = isinstance(event, self._connection.etcd3.events.DeleteEvent)
        keys = self._keys
        if key == keys.state:
            if deleted:
                self._state = (None, int(event.mod_revision))
                return
            try:
                state = RoundState.decode(event.value, key)
            except RendezvousStateError as exc:
                log.warning("etcd-v3: ignoring a bad rendezvous state: %s", exc)
                return
            self._take_state(state, int(event.mod_revision))
        elif key == keys.coordinator:
            self._coordinator_id = None if deleted else bytes(event.value).decode(errors="replace")
            if self._coordinator_id is None:
                self._schedule_claim()
        elif key == keys.master:
            self._master = None if deleted else MasterInfo.decode(event.value)
        elif key == self._shard_key and not deleted:
            try:
                self._shard = decode_shard(event.value, key)
            except RendezvousStateError as exc:
                log.warning("etcd-v3: ignoring a bad rank shard: %s", exc)

    def _take_state(self, state: RoundState, revision: int) -> None:
        if revision < self._state[1]:
            return
        self._state = (state, revision)
        self._latest_round = max(self._latest_round, state.round)
        self._closed = state.status == CLOSED

    def _sync(self) -> None:
        """Read the ``state*`` keys and this node's shard at one revision; watch from the next."""
        conn = self._connection
        response = etcd_ops.get_range(
            conn,
            self._keys.state,
            prefix=True,
            what="a rendezvous state read",
            deadline=self._deadline,
        )
        # The shard is read after the state: the watches start at the state's revision, so a
        # shard written in between arrives once more through them (harmless).
        shard_response = etcd_ops.get_range(
            conn, self._shard_key, what="a rank read", deadline=self._deadline
        )
        coordinator = master = None
        state: tuple[RoundState, int] | None = None
        for kv in response.kvs:
            key = kv.key.decode()
            if key == self._keys.state:
                state = (RoundState.decode(kv.value, key), int(kv.mod_revision))
            elif key == self._keys.coordinator:
                coordinator = bytes(kv.value).decode(errors="replace")
            elif key == self._keys.master:
                master = MasterInfo.decode(kv.value)
        if state is not None:
            self._take_state(*state)
        self._coordinator_id, self._master = coordinator, master
        if shard_response.kvs:
            self._shard = decode_shard(bytes(shard_response.kvs[0].value), self._shard_key)
        self._watch.ensure(int(response.header.revision) + 1)
        if state is not None and coordinator is None:
            self._schedule_claim()

    def _recheck(self) -> None:
        """One read of the state: if the watch missed a change, start it again from a read."""
        state, revision = self._read_state()
        if revision > self._state[1]:
            log.warning("etcd-v3: the rendezvous watch fell behind; reading again")
            self._watch.cancel()
            self._sync()

    def _read_state(self) -> tuple[RoundState | None, int]:
        value, meta = self._connection.call(
            lambda c: c.get(self._keys.state), what="a rendezvous state read", read=True
        )
        if value is None:
            return None, 0
        return RoundState.decode(value, self._keys.state), int(meta.mod_revision)

    # -- the coordinator role ---------------------------------------------------------------------

    def _schedule_claim(self) -> None:
        if self._claim_pending or self._slot.left:
            return
        self._claim_pending = True
        self._scheduler.call_later(jitter.uniform(0.0, self._spread()), self._try_claim)

    def _spread(self) -> float:
        """Over how many seconds the nodes of a job spread a write that only one of them needs
        to make (open the first round, claim the coordinator role)."""
        return min(float(self._settings.lease_ttl), self._settings.max_nodes * _SPREAD_S_PER_NODE)

    def _try_claim(self) -> None:
        """Claim the vacant coordinator key (on the scheduler thread)."""
        self._claim_pending = False
        if self._slot.left or self._coordinator_id is not None or self._state[0] is None:
            return
        conn, key = self._connection, self._keys.coordinator
        try:
            lease = self._lease.lease_id()
            result = etcd_ops.transaction(
                conn,
                [etcd_ops.absent(conn, key)],
                [etcd_ops.put(conn, key, self.node_id.encode(), lease)],
                [etcd_ops.get(conn, key)],
                what="a coordinator claim",
                retry_timeout=min(self._settings.retry_timeout, 5.0),
                deadline=self._deadline,
            )
        except Exception as exc:
            log.info("etcd-v3: claiming the coordinator role failed (%s); trying again", exc)
            if not self._slot.left:
                self._claim_pending = True
                self._scheduler.call_later(1.0, self._try_claim)
            return
        holder = (
            self.node_id
            if result.succeeded
            else (etcd_ops.first_value(result.responses[0])[0] or b"").decode()
        )
        if holder == self.node_id:
            self._start_coordinator()

    def _start_coordinator(self) -> None:
        with self._slot.lock:
            if self._slot.left or (
                self._slot.coordinator is not None and self._slot.coordinator.running
            ):
                return
            coordinator = RoundCoordinator(
                self._connection,
                self._keys,
                self._settings,
                self.node_id,
                make_master=self._serve_round,
                on_stop=self._coordinator_stopped,
                progress_interval=self._PROGRESS_LOG_S,
                deadline=self._deadline,
            )
            self._slot.coordinator = coordinator
        log.info("etcd-v3: node %s coordinates run %s", self.node_id, self._settings.run_id)
        coordinator.start()

    def _coordinator_stopped(self) -> None:
        with self._slot.lock:
            self._slot.coordinator = None
        if self._coordinator_id in (None, self.node_id):  # not deposed: the role is vacant
            self._coordinator_id = None
            self._scheduler.call_later(1.0, self._schedule_claim)

    @property
    def _coordinator(self) -> RoundCoordinator | None:
        """The coordinator this node runs, if it holds the role."""
        return self._slot.coordinator

    # -- rank 0's store ---------------------------------------------------------------------------

    def _serve_round(self, round_: int) -> MasterInfo:
        """Start (once per round) the store rank 0 serves to the workers; its address."""
        with self._tcp_lock:
            if self._tcp_store is None or self._tcp_store_round != round_:
                self._tcp_store = dist.TCPStore(
                    host_name=self._addr, port=0, is_master=True, multi_tenant=True
                )
                self._tcp_store_round = round_
            return MasterInfo(round_, self._addr, self._tcp_store.port)

    def _master_of(self, state: RoundState, rank: int) -> MasterInfo | None:
        """Rank 0's store address for ``state``'s round: from the state, the master key, or (as
        rank 0) by starting the store and publishing it; ``None`` while it is not known yet."""
        master = MasterInfo.of_state(state)
        if master is not None:
            return master
        master = self._master
        if master is not None and master.round == state.round:
            return master
        if rank != 0:
            return None
        master = self._serve_round(state.round)
        etcd_ops.put_key(
            self._connection,
            self._keys.master,
            master.encode(),
            what="a store address",
            deadline=self._deadline,
        )
        self._master = master
        return master

    # -- the protocol -----------------------------------------------------------------------------

    def _join_round(self, deadline: float) -> tuple[int, int, int, MasterInfo]:
        """Join (or open) a round and wait until it closes with this node in it.

        Returns:
            This node's rank, the world size, the round and rank 0's store address.
        """
        settings = self._settings
        wait = _JoinWait(time.monotonic() + self._PROGRESS_LOG_S, self._next_recheck())
        while True:
            if self._lease.revoked:  # left (from another thread) while joining: never join again
                raise RendezvousClosedError(f"etcd-v3: this node left run {settings.run_id!r}")
            seen = self._watch.version
            if self._watch._broken:
                self._sync()
            elif (
                time.monotonic() >= wait.recheck_at
            ):  # nothing heard for long: is the watch behind?
                self._recheck()
                wait.recheck_at = self._next_recheck()
            state, revision = self._state
            now = time.monotonic()
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"etcd-v3: no rendezvous of run {settings.run_id!r} within {settings.join_timeout:g}s: "
                    f"{self._waiting_summary()}"
                )
            if state is None:
                if wait.creation_due is None:  # wait a moment: another node may be creating it
                    wait.creation_due = now + jitter.uniform(0.0, self._spread())
                if now >= wait.creation_due:
                    self._create_state()
                else:
                    self._watch.wait(seen, wait.creation_due - now)
                continue
            if self._coordinator_id is None:
                self._schedule_claim()
            if state.status == CLOSED:
                raise RendezvousClosedError(f"the rendezvous of run {settings.run_id!r} is closed")
            if state.status == COMPLETE:
                outcome = self._in_complete_round(state, revision, wait.joined, now)
                if outcome is None:
                    continue
                if isinstance(outcome, tuple):
                    return outcome
                timeout = outcome
            elif wait.joined != (state.round, self._lease.current()):
                if self._join(state.round):
                    wait.joined = (state.round, self._lease.current() or 0)
                    wait.min_seen_at = None
                continue
            else:  # open, joined: wait for the coordinator to close it
                timeout = self._open_round_wait(state, wait, now, deadline)
            self._watch.wait(seen, min(timeout, wait.recheck_at - now, deadline - now))
            if self._watch.version != seen:
                wait.recheck_at = self._next_recheck()

    def _next_recheck(self) -> float:
        """When to read the state if no event came by then (a stalled stream?)."""
        return time.monotonic() + self._SAFETY_RECHECK_S * jitter.uniform(0.8, 1.2)

    def _in_complete_round(
        self, state: RoundState, revision: int, joined: tuple[int, int] | None, now: float
    ) -> tuple[int, int, int, MasterInfo] | float | None:
        """What a complete ``state`` means for this node: its rank, world size, round and rank
        0's address (it is in the round), how long to wait at most (it waits for its shard or
        the address, or as a spare of a full job), or ``None`` (it acted: look again at once)."""
        rank = self._rank_in(state, joined)
        if rank is not None:
            master = self._master_of(state, rank)
            if master is not None:
                return rank, state.world_size, state.round, master
            if self._waited_for(state, "master", now, 5.0):
                self._sync_master()
                return None
            return 1.0  # rank 0 publishes its address at once; read it if it is late
        if self._is_pending(state, joined, now):
            return 0.5  # the shard of this round has not arrived yet
        if self._round == state.round or state.world_size < self._settings.max_nodes:
            # A restart (this node ran the round) or room for a newcomer: open the next round;
            # the running members see it and rejoin.
            self._write_state(
                RoundState(state.round + 1, OPEN, previous_round=state.round), revision
            )
            return None
        return math.inf  # the job is full: wait as a spare until a round opens

    def _open_round_wait(
        self, state: RoundState, wait: _JoinWait, now: float, deadline: float
    ) -> float:
        """How long to wait in the open round this node joined; while nodes are missing (below
        the minimum, or in a first round's last call) it says so now and then."""
        settings = self._settings
        count = max(state.joined, 1)
        if count >= settings.min_nodes and wait.min_seen_at is None:
            wait.min_seen_at = now
        first_round = state.previous_round is None
        in_last_call = wait.min_seen_at is not None and first_round and count < settings.max_nodes
        if wait.min_seen_at is not None and not in_last_call:
            return math.inf
        if now >= wait.next_progress_at:
            waited = 0.0 if wait.min_seen_at is None else now - wait.min_seen_at
            self._log_progress(count, deadline - now, settings.last_call_timeout - waited)
            wait.next_progress_at = now + self._PROGRESS_LOG_S
        return wait.next_progress_at - now

    def _rank_in(self, state: RoundState, joined: tuple[int, int] | None) -> int | None:
        """This node's rank in the complete ``state`` if it is a participant (per its shard)."""
        if state.round <= self._round and not (joined is not None and joined[0] == state.round):
            return None  # a round this node already ran: not a new one for it
        shard = self._shard
        if state.shards != self._shards:  # settings differ between nodes: read the right shard
            shard = self._read_shard(state)
        if shard is None or shard[0] != state.round:
            return None
        return shard[1].get(self.node_id)

    def _is_pending(self, state: RoundState, joined: tuple[int, int] | None, now: float) -> bool:
        """Whether this node joined ``state``'s round but its shard has not arrived yet."""
        if joined is None or joined[0] != state.round:
            return False
        shard = self._shard
        if shard is not None and shard[0] >= state.round:
            return False
        if self._waited_for(state, "shard", now, 2.0):
            self._shard = self._read_shard(state)
        return True

    def _waited_for(self, state: RoundState, what: str, now: float, patience: float) -> bool:
        """True once per round and ``what`` after waiting ``patience`` seconds for it (the
        watch should have brought it: the caller then reads it)."""
        marks = self._wait_marks
        key = (state.round, what)
        since = marks.setdefault(key, now)
        if now - since >= patience:
            marks[key] = float("inf")
            if len(marks) > 16:
                marks.clear()
            return True
        return False

    def _read_shard(self, state: RoundState) -> tuple[int, dict[str, int]] | None:
        key = self._keys.shard(shard_of(self.node_id, max(state.shards, 1)))
        value, _ = self._connection.call(lambda c: c.get(key), what="a rank read", read=True)
        return None if value is None else decode_shard(value, key)

    def _sync_master(self) -> None:
        value, _ = self._connection.call(
            lambda c: c.get(self._keys.master), what="a store address read", read=True
        )
        if value is not None:
            self._master = MasterInfo.decode(value)

    def _join(self, round_: int) -> bool:
        """Put this node's join key for ``round_``; False if the lease had expired (registered
        again: the caller looks again)."""
        lease = self._lease.lease_id()
        key = self._keys.joined(round_, self.node_id)
        try:
            etcd_ops.put_key(
                self._connection, key, b"", lease, what="a rendezvous join", deadline=self._deadline
            )
        except RendezvousConnectionError as exc:
            if not _lease_not_found(exc):
                raise
            # Cut off longer than lease_ttl (a partition): our lease expired. Register again
            # under a new lease and retry the join.
            log.warning("etcd-v3: this node's lease expired; registering again")
            self._lease.invalidate(lease)
            return False
        return True

    def _create_state(self) -> None:
        """Open the job's first round and take the coordinator role with it."""
        conn, keys = self._connection, self._keys
        lease = self._lease.lease_id()
        result = etcd_ops.transaction(
            conn,
            [etcd_ops.absent(conn, keys.state)],
            [
                etcd_ops.put(conn, keys.state, RoundState(0, OPEN).encode()),
                etcd_ops.put(conn, keys.coordinator, self.node_id.encode(), lease),
            ],
            [etcd_ops.get(conn, keys.state, prefix=True)],
            what="a rendezvous state change",
            deadline=self._deadline,
        )
        if result.succeeded:
            self._take_state(RoundState(0, OPEN), result.revision)
            self._coordinator_id = self.node_id
            self._start_coordinator()
            return
        for kv in etcd_ops.range_kvs(result.responses[0]):
            key = kv.key.decode()
            if key == keys.state:
                self._take_state(RoundState.decode(kv.value, key), int(kv.mod_revision))
            elif key == keys.coordinator:
                self._coordinator_id = bytes(kv.value).decode(errors="replace")
                if self._coordinator_id == self.node_id:  # our own attempt, retried
                    self._start_coordinator()

    def _write_state(self, new: RoundState, revision: int) -> None:
        """CAS the state from ``revision`` to ``new``; on a conflict take the current state."""
        conn, key = self._connection, self._keys.state
        result = etcd_ops.transaction(
            conn,
            [etcd_ops.mod_is(conn, key, revision)],
            [etcd_ops.put(conn, key, new.encode())],
            [etcd_ops.get(conn, key)],
            what="a rendezvous state change",
            deadline=self._deadline,
        )
        if result.succeeded:
            self._take_state(new, result.revision)
            return
        value, current_rev = etcd_ops.first_value(result.responses[0])
        if value is not None:
            self._take_state(RoundState.decode(value, key), current_rev)

    def _waiting_summary(self) -> str:
        try:
            snapshot = read_snapshot(self._connection, self._keys)
        except Exception as exc:
            return f"the rendezvous could not be read ({exc})"
        return waiting_summary(snapshot, self._settings, self.node_id)

    def _log_progress(self, joined: int, left: float, last_call_left: float) -> None:
        settings = self._settings
        if joined < settings.min_nodes:
            log.warning(
                "etcd-v3: run %s: waiting for nodes: %d of min %d joined, %.0f s left",
                settings.run_id,
                joined,
                settings.min_nodes,
                max(left, 0.0),
            )
        else:
            log.warning(
                "etcd-v3: run %s: waiting for more nodes: %d joined (min %d, max %d), "
                "last call ends in %.0f s",
                settings.run_id,
                joined,
                settings.min_nodes,
                settings.max_nodes,
                max(last_call_left, 0.0),
            )


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
            claim_run(
                connection, RunKeys.from_settings(settings).job, identity, run_id=settings.run_id
            )
        return LeaseRendezvousHandler(connection, settings, owns_connection=True)
    except BaseException:
        connection.close()
        raise
