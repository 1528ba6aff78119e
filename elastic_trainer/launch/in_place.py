"""The launcher's side of in-place healing: torchrun's agent becomes a local supervisor.

With ``--heal in_place`` (the default of ``elastic-trainer run``) the job's membership after its
first rendezvous is the workers' own (:mod:`elastic_trainer.heal`). The agent keeps what it is
good at -- starting this node's workers, watching them, the failure policy, the exit -- and
stops re-forming the whole job:

* the first ``next_rendezvous`` of a node that starts a new job is torchrun's (the ``etcd-v3``
  round, with its minimum and last call); every later one, and the first one of a node that joins
  a job already running, returns at once with a one-node placeholder and starts the node's
  workers as *joiners*: they join the running group in place and take the state from a peer;
* ``num_nodes_waiting()`` is 0: a new node or a lost one is the workers' business, not a reason
  to restart every worker of every node;
* each launcher holds a key ``nodes/<node>`` on a short lease (:data:`NODE_LEASE_TTL_S`, kept
  alive beside the rendezvous' long one): a job whose epoch names a node whose key lives is
  running, one whose nodes are all gone (a crashed earlier job with the same run id) is not;
* every launcher watches those keys: when a member node's key expires (a node lost without a
  goodbye: power, network, a partition; no connection breaks, so no collective fails) it opens a
  heal round, and the survivors' workers abort their group and go on without it;
* the launchers also send each other heartbeats (:mod:`elastic_trainer.launch.peer_heartbeat`,
  addresses in those keys): a member node silent for 0.8 s is reported the same way, well before
  its lease expires;
* every new epoch that is not a first rendezvous is a heal: the launcher's ``on_heal`` callback
  hears of it (it counts heals and reports their root cause, :func:`describe_heal`);
* the liveness lease and the watches go over the ``etcd-v3`` handler's own etcd connection
  (:func:`etcd_connection_for`): one keep-alive stream and one watch stream per launcher, not two
  of each. The inner handler owns and closes it; this one leaves first (``shutdown``, ``leave``),
  and what its lease's expiry does (registering again, etcd calls that may wait) runs on a
  thread of its own, never on the shared keeper's reader.

Everything else (close, shutdown, run id, store) is the ``etcd-v3`` handler's.
Design: ``docs/design/heal-in-place.md``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed import HashStore, PrefixStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from elastic_trainer.heal.membership import HealKeys
from elastic_trainer.heal.protocol import Epoch, ProtocolError
from elastic_trainer.launch.peer_heartbeat import SILENT_AFTER_S, PeerHeartbeats, route_address
from elastic_trainer.runtime.settings import (
    ENV_HEAL_JOIN,
)
from rendezvous import etcd_ops
from rendezvous.etcd_client import EtcdConnection
from rendezvous.lease_keeper import LeaseKeeper
from rendezvous.plugin import create_rdzv_handler
from rendezvous.settings import parse_settings
from rendezvous.watch_hub import WatchHub

log = logging.getLogger(__name__)

NODE_LEASE_TTL_S = 2
"""TTL of a node's liveness key: etcd's smallest with its default election timeout (1 s: 1.5 x
1 s, rounded up). Renewed every 0.67 s (a third), so one lost renewal is survived; a node is
declared lost 2 to 2.5 s after its last renewal (etcd checks expiries every 0.5 s)."""
BACKEND_NAME = "elastic-trainer-in-place"
"""The rendezvous backend name ``elastic-trainer run`` gives torchrun when it heals in place."""
HEARTBEAT_REPORT_RETRY_S = 2.0
"""How long a launcher tries to reach etcd to report a silent peer: one that cannot is more likely
cut off itself (the report would open a needless round once it is back); a node really lost is
still found by its lease."""
OUTAGE_GRACE_S = 10.0
"""After this launcher lost its watch stream (etcd away), node keys expiring within this many
seconds may be the outage's doing, not the nodes' (see ``_still_lost``)."""
FIRST_EPOCH_REASON = "rendezvous"
"""The reason of an epoch formed by torchrun's rendezvous (a start or a restart, not a heal)."""

HealCallback = Callable[[Epoch, Sequence[str]], None]
"""``on_heal(epoch, causes)``: called from a watch thread (must not block) for each new epoch that
is a heal; ``causes``: one line per member node whose liveness key expired that this launcher
reported since the previous epoch."""


class HealReports:
    """Turns the epochs a launcher sees into ``on_heal`` calls: once per epoch (numbers only grow),
    none for a first rendezvous or a finished run, with the causes noted since the last one."""

    def __init__(self, on_heal: HealCallback | None) -> None:
        self._on_heal = on_heal
        self._last_epoch = 0
        self._causes: list[str] = []
        self._lock = threading.Lock()

    def note_cause(self, text: str) -> None:
        """Something this launcher saw that the next heal is about (a member node lost)."""
        with self._lock:
            self._causes.append(text)

    def saw(self, epoch: Epoch) -> None:
        with self._lock:
            if epoch.finished or epoch.number <= self._last_epoch:
                return
            self._last_epoch = epoch.number
            causes, self._causes = self._causes, []
        if epoch.reason != FIRST_EPOCH_REASON and self._on_heal is not None:
            try:
                self._on_heal(epoch, causes)
            except Exception as exc:  # noqa: BLE001 - a report must not stop the watch
                log.warning("in-place: reporting heal %d failed: %s", epoch.number, exc)


def describe_heal(epoch: Epoch, causes: Sequence[str], *, restarted: bool = False) -> str:
    """One line for ``status``: what happened (``causes``, if this node knows them) and how the
    job went on. ``restarted``: this node's workers had stopped (a node asked to stop makes every
    rank checkpoint at the same step and exit, docs/rendezvous.md) and the new ones joined the
    epoch: not a heal in place for this node, whatever the epoch is for the others."""
    # The survivors' step, not necessarily the one restored: a sharded state whose lost shards have
    # no current copy goes back to the newest checkpoint (its workers log the step and what is redone).
    start = f"survivors at step {epoch.step}" if epoch.step >= 0 else "from the newest checkpoint"
    how = "workers restarted (they had stopped with the job)" if restarted else "healed in place"
    outcome = f"{how}: epoch {epoch.number}, {epoch.world_size} worker(s), {start}"
    return (
        f"{'; '.join(causes)}; {outcome}" if causes else f"{epoch.reason or 'a fault'}; {outcome}"
    )


def node_key(keys: HealKeys, node: str) -> str:
    return f"{keys.prefix}nodes/{node}"


def node_record(heartbeat: str | None) -> bytes:
    """The value of a node's liveness key: where it listens for heartbeats."""
    return json.dumps({"heartbeat": heartbeat}).encode()


def heartbeat_address(value: bytes) -> str | None:
    """The heartbeat address in a node's liveness key (``None``: none, or not readable)."""
    try:
        address = json.loads(value).get("heartbeat")
    except (ValueError, AttributeError):
        return None
    return address if isinstance(address, str) else None


def running_epoch(connection: EtcdConnection, keys: HealKeys, *, own_node: str) -> Epoch | None:
    """The job's current epoch if the job is running: not finished, and at least one of its
    members' nodes (not this one) holds its key."""
    response = etcd_ops.get_range(
        connection, keys.prefix, prefix=True, what="reading the heal state"
    )
    epoch, nodes = None, set()
    node_prefix = node_key(keys, "")
    for kv in response.kvs:
        key = kv.key.decode()
        if key == keys.epoch:
            try:
                epoch = Epoch.decode(bytes(kv.value))
            except ProtocolError as exc:
                log.warning("in-place: ignoring %s", exc)
        elif key.startswith(node_prefix):
            nodes.add(key[len(node_prefix) :])
    if epoch is None or epoch.finished:
        return None
    member_nodes = {member.slot.rsplit("/", 1)[0] for member in epoch.members}
    return epoch if (member_nodes & nodes) - {own_node} else None


def open_round_for_lost_node(
    connection: EtcdConnection,
    keys: HealKeys,
    node: str,
    *,
    why: str,
    retry_timeout: float | None = None,
) -> bool:
    """If ``node`` is a member of the job's current epoch, open the next round; True if opened
    (by this call or already). ``why``: how it was found lost, for the log; ``retry_timeout``: of
    each etcd request (the connection's by default)."""
    response = etcd_ops.get_range(
        connection, keys.epoch, what="reading the heal epoch", retry_timeout=retry_timeout
    )
    if not response.kvs:
        return False
    try:
        epoch = Epoch.decode(bytes(response.kvs[0].value))
    except ProtocolError:
        return False
    if epoch.finished or not any(member.slot.rsplit("/", 1)[0] == node for member in epoch.members):
        return False
    number = epoch.number + 1
    key = keys.open(number)
    etcd_ops.transaction(
        connection,
        [etcd_ops.absent(connection, key)],
        [etcd_ops.put(connection, key, f"launcher node {node} lost".encode())],
        what="opening a heal round",
        deadline=2.0,
        retry_timeout=retry_timeout,
    )
    log.warning(
        "in-place: node %s is gone (%s); its peers heal without it (round %d)", node, why, number
    )
    return True


class InPlaceRendezvousHandler(RendezvousHandler):
    """Wraps the ``etcd-v3`` handler; see the module docstring."""

    def __init__(
        self,
        inner: RendezvousHandler,
        connection: EtcdConnection,
        *,
        run_id: str,
        node: str,
        lease_ttl: int = NODE_LEASE_TTL_S,
        on_heal: HealCallback | None = None,
        heartbeat_host: str | None = None,
    ) -> None:
        """``heartbeat_host``: the address peers send this node's heartbeats to (``None``: no
        heartbeats; a lost node is noticed by its lease)."""
        self._inner = inner
        self._reports = HealReports(on_heal)
        self._connection = connection
        self._keys = HealKeys.of(run_id)
        self._node = node
        self._formed_once = False
        self._lost_nodes: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self._heartbeats = (
            None
            if heartbeat_host is None
            else PeerHeartbeats(
                run_id=run_id,
                node=node,
                advertise_host=heartbeat_host,
                on_silent=lambda peer: self._lost_nodes.put((peer, "heartbeat")),
            )
        )
        self._peer_addresses: dict[str, str] = {}
        self._peers_lock = threading.Lock()
        self._left = False
        # Training ended (rank 0 marked the epoch finished): the workers are leaving with success;
        # a node lost now (its rendezvous lease expiring) is no reason to restart them.
        self._finished = False
        revision = self._register_and_watch(lease_ttl)
        self._read_peers()
        threading.Thread(target=self._report_lost_nodes, name="in-place-nodes", daemon=True).start()
        # Whether the job's workers heal in place at all: they say so by writing an epoch (the
        # Trainer does; a script with its own loop does not, and keeps torchrun's restarts).
        self._heals = running_epoch(connection, self._keys, own_node=node) is not None
        self._epoch_watch = WatchHub.of(connection).watch(
            self._keys.epoch,
            start_revision=revision + 1,
            on_events=self._on_epoch_events,
            on_lost=self._on_watch_lost,
        )

    def _register_and_watch(self, lease_ttl: int) -> int:
        """Register this node under a lease kept alive, and watch the job's nodes from then on;
        the registration's revision. Should registering fail, the heartbeats stop too."""
        connection = self._connection
        try:
            self._lease_id = int(
                connection.call(lambda client: client.lease(lease_ttl), what="a lease grant").id
            )
            revision = etcd_ops.put_key(
                connection,
                node_key(self._keys, self._node),
                self._record(),
                lease=self._lease_id,
                what="registering this node",
            )
        except BaseException:
            if self._heartbeats is not None:
                self._heartbeats.close()
            raise
        LeaseKeeper.of(connection).keep(
            self._lease_id, lease_ttl, lambda _lease: self._on_lease_expired(lease_ttl)
        )
        self._watch = WatchHub.of(connection).watch(
            node_key(self._keys, ""),
            start_revision=revision + 1,
            on_events=self._on_node_events,
            on_lost=self._on_watch_lost,
            prefix=True,
        )
        return revision

    def _on_epoch_events(self, events: list[Any]) -> None:
        deleted = self._connection.etcd3.events.DeleteEvent
        for event in events:
            if isinstance(event, deleted):
                continue
            try:
                epoch = Epoch.decode(bytes(event.value))
            except ProtocolError:
                continue
            self._heals = not epoch.finished
            self._finished = self._finished or epoch.finished
            self._reports.saw(epoch)

    # -- lost nodes ----------------------------------------------------------------------------
    def _record(self) -> bytes:
        return node_record(self._heartbeats.address if self._heartbeats is not None else None)

    def _read_peers(self) -> None:
        """The nodes registered before this one's watch started, and their heartbeat addresses."""
        prefix = node_key(self._keys, "")
        response = etcd_ops.get_range(
            self._connection, prefix, prefix=True, what="reading the job's nodes"
        )
        with self._peers_lock:
            for kv in response.kvs:
                address = heartbeat_address(bytes(kv.value))
                if address is not None:
                    self._peer_addresses.setdefault(kv.key.decode()[len(prefix) :], address)
        self._update_heartbeats()

    def _update_heartbeats(self) -> None:
        if self._heartbeats is not None:
            with self._peers_lock:  # held across: two updates never apply out of order
                self._heartbeats.set_peers(dict(self._peer_addresses))

    def _on_node_events(self, events: list[Any]) -> None:
        deleted = self._connection.etcd3.events.DeleteEvent
        prefix = node_key(self._keys, "")
        for event in events:
            key = event.key.decode() if isinstance(event.key, bytes) else str(event.key)
            node = key[len(prefix) :]
            with self._peers_lock:
                if isinstance(event, deleted):
                    self._peer_addresses.pop(node, None)
                elif (address := heartbeat_address(bytes(event.value))) is not None:
                    self._peer_addresses[node] = address
            if isinstance(event, deleted):
                self._lost_nodes.put((node, "lease"))
        self._update_heartbeats()

    def _on_watch_lost(self, reason: str) -> None:
        log.warning(
            "in-place: the watch of the job's nodes is lost (%s); lost nodes are noticed by their "
            "collectives only",
            reason,
        )

    def _report_lost_nodes(self) -> None:
        """Open a heal round for each member node whose key expired or whose heartbeats stopped
        (never blocks the watch or the heartbeats)."""
        while True:
            item = self._lost_nodes.get()
            if item is None:
                return
            node, found_by = item
            try:
                if found_by == "lease" and not self._still_lost(node):
                    log.warning(
                        "in-place: node %s registered again after an etcd outage; not lost", node
                    )
                    continue
                by_heartbeat = found_by == "heartbeat"
                if (
                    by_heartbeat
                    and self._heartbeats is not None
                    and not self._heartbeats.still_silent(node)
                ):
                    continue  # heard again meanwhile
                why = (
                    f"no heartbeat for {SILENT_AFTER_S:g} s"
                    if by_heartbeat
                    else f"its {NODE_LEASE_TTL_S} s liveness lease expired"
                )
                if open_round_for_lost_node(
                    self._connection,
                    self._keys,
                    node,
                    why=why,
                    retry_timeout=HEARTBEAT_REPORT_RETRY_S if by_heartbeat else None,
                ):
                    self._reports.note_cause(f"node {node} lost ({why})")
            except Exception as exc:  # noqa: BLE001 - the workers' collectives still notice, later
                log.warning("in-place: could not report node %s lost: %s", node, exc)

    def _still_lost(self, node: str) -> bool:
        """Whether ``node``'s expired key means the node is gone. Right after etcd itself was away
        (this launcher's watch stream failed within :data:`OUTAGE_GRACE_S`), every node's short
        lease may have run out with it: the node gets two TTLs to register again first."""
        failed = WatchHub.of(self._connection).last_failure
        if failed is None or time.monotonic() - failed > OUTAGE_GRACE_S:
            return True
        key = node_key(self._keys, node)
        deadline = time.monotonic() + 2 * NODE_LEASE_TTL_S
        while time.monotonic() < deadline:
            if etcd_ops.get_range(self._connection, key, what="reading a node's liveness key").kvs:
                return False
            time.sleep(0.2)
        return True

    def _on_lease_expired(self, lease_ttl: int) -> None:
        """(The keeper's reader thread, shared with the rendezvous' lease: must not block)."""
        if self._left:
            return
        threading.Thread(
            target=self._register_again, args=(lease_ttl,), name="in-place-register", daemon=True
        ).start()

    def _register_again(self, lease_ttl: int) -> None:
        log.warning(
            "in-place: this node's lease expired (etcd unreachable for %d s); registering again",
            lease_ttl,
        )
        try:
            self._lease_id = int(
                self._connection.call(lambda c: c.lease(lease_ttl), what="a lease grant").id
            )
            etcd_ops.put_key(
                self._connection,
                node_key(self._keys, self._node),
                self._record(),
                lease=self._lease_id,
                what="registering this node",
            )
            LeaseKeeper.of(self._connection).keep(
                self._lease_id, lease_ttl, lambda _lease: self._on_lease_expired(lease_ttl)
            )
        except Exception as exc:  # noqa: BLE001 - retried at the next expiry; joins still work
            log.warning("in-place: registering again failed: %s", exc)

    # -- RendezvousHandler ---------------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND_NAME  # torch checks the handler's name against the requested backend

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def next_rendezvous(self) -> RendezvousInfo:
        running = (
            None
            if self._formed_once
            else running_epoch(self._connection, self._keys, own_node=self._node)
        )
        if (self._formed_once and self._heals) or running is not None:
            os.environ[ENV_HEAL_JOIN] = "1"
            if running is not None:
                log.warning(
                    "in-place: job %s is running (epoch %d, %d workers); this node's workers join it in place",
                    self.get_run_id(),
                    running.number,
                    running.world_size,
                )
            else:
                log.warning(
                    "in-place: this node's workers restart and join the running job in place"
                )
            self._formed_once = True
            # torchrun needs a rank and a store for its own bookkeeping; the workers ignore both.
            store = PrefixStore("in-place-placeholder", HashStore())
            return RendezvousInfo(store, 0, 1, RendezvousStoreInfo("127.0.0.1", 0))
        os.environ[ENV_HEAL_JOIN] = "0"
        if self._formed_once:
            log.warning(
                "in-place: this job's workers do not heal in place (no epoch written); torchrun restarts them"
            )
        info = self._inner.next_rendezvous()
        self._formed_once = True
        return info

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        # Workers that heal in place take joins and losses in; others restart as with torchrun.
        return 0 if self._heals or self._finished else self._inner.num_nodes_waiting()

    def shutdown(self) -> bool:
        self._leave()
        return self._inner.shutdown()

    def leave(self) -> None:
        """Leave the run without closing it (a launcher stopped by a signal; torch does not call
        :meth:`shutdown` then): peers see this node go at once, and nothing is left to do at
        interpreter exit, when the embedded etcd is already stopped."""
        self._leave()
        inner_leave = getattr(self._inner, "leave", None)
        if inner_leave is not None:
            inner_leave()

    def _leave(self) -> None:
        if self._left:
            return
        self._left = True
        self._lost_nodes.put(None)
        if self._heartbeats is not None:
            self._heartbeats.close()
        self._watch.cancel()
        self._epoch_watch.cancel()
        LeaseKeeper.of(self._connection).forget(self._lease_id)
        try:
            self._connection.call(
                lambda client: client.revoke_lease(self._lease_id),
                what="a lease revoke",
                retry_timeout=2.0,
            )
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            log.debug("in-place: revoking this node's lease failed: %s", exc)


_HANDLERS: weakref.WeakSet[InPlaceRendezvousHandler] = weakref.WeakSet()
"""The handlers :func:`register_backend`'s factory made in this process (for :func:`leave_all`)."""


def job_heals_now() -> bool:
    """Whether a handler of this process sees its job healing in place (an epoch written by the
    workers, not finished): a killed worker is then replaced, not its group restarted."""
    return any(handler._heals and not handler._finished for handler in list(_HANDLERS))


def leave_all() -> None:
    """Every handler of this process leaves its run (see :meth:`InPlaceRendezvousHandler.leave`);
    the launcher calls it before it stops its embedded etcd. Never raises."""
    for handler in list(_HANDLERS):
        try:
            handler.leave()
        except Exception as exc:  # noqa: BLE001 - the leases expire on their own
            log.info("in-place: leaving the run failed: %s", exc)


def etcd_connection_for(inner: RendezvousHandler) -> EtcdConnection:
    """The etcd connection the in-place handler around ``inner`` uses: ``inner``'s own (the lease
    handler exposes it as ``connection``), so that the launcher runs one keep-alive and one watch
    stream.

    Raises:
        TypeError: ``inner`` has no etcd connection (it is not the ``etcd-v3`` handler).
    """
    connection = getattr(inner, "connection", None)
    if not isinstance(connection, EtcdConnection):
        raise TypeError(f"in-place healing needs the etcd-v3 handler, got {type(inner).__name__}")
    return connection


def register_backend(*, node: str, on_heal: HealCallback | None = None) -> None:
    """Register :data:`BACKEND_NAME` with torch: the ``etcd-v3`` handler, wrapped."""

    def create(params: RendezvousParameters) -> RendezvousHandler:
        inner = create_rdzv_handler(params)
        config = parse_settings(params).client_config()
        connection = etcd_connection_for(inner)
        # Peers send heartbeats where they reach this node: torchrun's --local-addr, else the
        # address of this host's route to etcd (the cluster's network).
        first = config.endpoints[0]
        host = params.local_addr or route_address(first.host, first.port)
        handler = InPlaceRendezvousHandler(
            inner, connection, run_id=params.run_id, node=node, on_heal=on_heal, heartbeat_host=host
        )
        _HANDLERS.add(handler)
        return handler

    registry: Any = rendezvous_handler_registry
    if registry._registry.get(BACKEND_NAME) is None:
        registry.register(BACKEND_NAME, create)
