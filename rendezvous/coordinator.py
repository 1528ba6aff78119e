"""The coordinator of a lease rendezvous: the one node that watches every member and decides.

Exactly one node of a run holds ``rdzv/state/coordinator`` (attached to its lease) and runs a
:class:`RoundCoordinator`. It reads the run once (``read_snapshot``), then follows it through
three watches -- ``rdzv/state*``, ``rdzv/nodes/``, ``rdzv/rounds/`` -- keeping counts, so that
deciding costs O(1) per event and O(N) once per round:

* **Close** an open round when :func:`~rendezvous.round_state.close_ready` holds: ranks ordered by
  :func:`~rendezvous.round_state.order_participants`, written as rank shards plus the state in
  one transaction. If the coordinator itself is rank 0 it creates rank 0's store first and puts
  its address in the state, so that nobody waits for another write.
* **Open** the next round when a participant of the running round loses its lease (death,
  partition, scale-down); every node's agent sees the new round and restarts its workers.
* **Say how many joined** (the count in the open state, at most twice per progress interval)
  while nodes wait for the minimum or in the first round's last call.

Every write compares the state's revision and the coordinator key's value: a coordinator that
lost its lease (and with it the key) can never publish. When its key goes, it stops; another node
claims the key (``lease_handler``) and starts from a fresh read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousStateError

from rendezvous import etcd_ops
from rendezvous.etcd_client import EtcdConnection
from rendezvous.round_state import (
    CLOSED,
    COMPLETE,
    OPEN,
    MasterInfo,
    RoundState,
    RunKeys,
    close_ready,
    encode_shard,
    order_participants,
    read_snapshot,
    shard_count,
    shard_of,
)
from rendezvous.settings import RendezvousSettings
from rendezvous.watch_hub import HubWatch, WatchHub

log = logging.getLogger(__name__)

_MAX_STALE_DELETES = 5


class _Deposed(Exception):
    """The coordinator key no longer names this node."""


class RoundCoordinator:
    """Decides the rounds of one run while this node holds the coordinator key.

    Args:
        make_master: called with a round number when this node is that round's rank 0; returns
            the address of the store it now serves for the round.
        on_stop: called once, from the coordinator's thread, when it stops for any reason.
        progress_interval: seconds between two progress lines of a waiting node.
        deadline: the gRPC deadline of one write attempt (default: ``read_timeout``).
    """

    def __init__(
        self,
        connection: EtcdConnection,
        keys: RunKeys,
        settings: RendezvousSettings,
        node_id: str,
        *,
        make_master: Callable[[int], MasterInfo],
        on_stop: Callable[[], None],
        progress_interval: float = 5.0,
        deadline: float | None = None,
    ) -> None:
        self._connection, self._keys, self._settings = connection, keys, settings
        self.node_id = node_id
        self._make_master, self._on_stop = make_master, on_stop
        self._progress_interval = progress_interval
        self._deadline = deadline
        self._hub = WatchHub.of(connection)
        self._cond = threading.Condition()
        self._dirty = True
        self._stopping = False
        self._needs_resync = True
        self._watches: list[HubWatch] = []
        self._thread: threading.Thread | None = None
        # The view, kept by the watches (all under self._cond).
        self._state: RoundState | None = None
        self._state_rev = 0
        self._live: dict[str, int] = {}  # node -> lease
        self._joined: dict[int, dict[str, int]] = {}  # round -> node -> create revision
        self._members: list[str] = []  # participants of round _members_round
        self._member_set: frozenset[str] = frozenset()
        self._members_round: int | None = None
        self._closing: int | None = (
            None  # the round this coordinator's close transaction is writing
        )
        self._lost: list[str] = []  # members gone from a complete round, not acted on yet
        self._previous: list[str] | None = None  # the open round's previous participants
        self._missing: set[str] = set()  # live previous participants not rejoined yet
        self._open_round: int | None = None
        self._min_reached_at: float | None = None
        self._published: tuple[int, float] = (-1, float("-inf"))
        self._wake_at = float("inf")

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="etcd-v3-coordinator", daemon=True)
        self._thread.start()

    def stop(self, wait: float = 0.0) -> None:
        """Stop deciding (idempotent); wait up to ``wait`` seconds for the thread to end."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        thread = self._thread
        # is_alive: a node may leave while another thread is about to start its coordinator
        if (
            wait > 0
            and thread is not None
            and thread.is_alive()
            and thread is not threading.current_thread()
        ):
            thread.join(wait)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def live_nodes(self) -> set[str]:
        """The nodes whose keys the coordinator sees now."""
        with self._cond:
            return set(self._live)

    def _run(self) -> None:
        backoff = 0.1
        released = False
        try:
            while self._wait_for_work():
                try:
                    if self._needs_resync:
                        self._resync()
                    self._step()
                    backoff = 0.1
                    continue
                except _Deposed:
                    log.info(
                        "etcd-v3: node %s no longer coordinates run %s",
                        self.node_id,
                        self._settings.run_id,
                    )
                    released = True
                    return
                except (RendezvousError, OSError, ValueError) as exc:  # etcd unreachable, bad state
                    log.warning(
                        "etcd-v3: the coordinator of run %s failed (%s); retrying in %.1f s",
                        self._settings.run_id,
                        exc,
                        backoff,
                    )
                except Exception:  # a bug: say so, and decide again from a fresh read
                    log.exception(
                        "etcd-v3: the coordinator of run %s failed; retrying in %.1f s",
                        self._settings.run_id,
                        backoff,
                    )
                self._backoff(backoff)
                backoff = min(backoff * 2, 5.0)
        finally:
            for watch in self._watches:
                watch.cancel()
            if (
                not released and not self._stopping
            ):  # the thread ended unexpectedly: let another node decide
                self._release()
            self._on_stop()

    def _wait_for_work(self) -> bool:
        """Wait until the view changed, a resync is due or a wake-up time came; False once
        stopping."""
        with self._cond:
            while not self._stopping and not self._dirty and not self._needs_resync:
                if self._wake_at == float("inf"):
                    self._cond.wait()
                    continue
                timeout = self._wake_at - time.monotonic()
                if timeout <= 0:
                    break
                self._cond.wait(timeout)
            if self._stopping:
                return False
            self._dirty = False
            self._wake_at = float("inf")
            return True

    def _backoff(self, seconds: float) -> None:
        with self._cond:
            self._needs_resync = True
            self._cond.wait(seconds)

    def _release(self) -> None:
        try:
            etcd_ops.transaction(
                self._connection,
                [
                    etcd_ops.value_is(
                        self._connection, self._keys.coordinator, self.node_id.encode()
                    )
                ],
                [etcd_ops.delete(self._connection, self._keys.coordinator)],
                what="a coordinator release",
                retry_timeout=2.0,
            )
        except Exception as exc:  # the key goes with this node's lease anyway
            log.info("etcd-v3: could not release the coordinator key: %s", exc)

    # -- the view ---------------------------------------------------------------------------------

    def _resync(self) -> None:
        snapshot = read_snapshot(self._connection, self._keys)
        if snapshot.coordinator != self.node_id:
            raise _Deposed
        for watch in self._watches:
            watch.cancel()
        with self._cond:
            self._live = dict(snapshot.leases)
            self._joined = {r: dict(nodes) for r, nodes in snapshot.join_revisions.items()}
            self._state, self._state_rev = None, 0
            self._open_round, self._lost = None, []
            state = snapshot.state
            if state is not None:
                if state.status == OPEN:
                    if state.previous_round is not None and state.previous is not None:
                        self._set_members(state.previous_round, state.previous)
                else:
                    self._set_members(state.round, state.participants)
                    gone = [m for m in self._members if m not in self._live]
                    if state.status == COMPLETE:
                        self._lost = gone
                    else:
                        for node in gone:
                            log.info("etcd-v3: node %s left the closed run", node)
                self._apply_state(state, snapshot.state_revision)
            self._needs_resync = False
            self._dirty = True
        keys = self._keys
        self._watches = [
            self._hub.watch(
                prefix,
                prefix=True,
                start_revision=snapshot.revision + 1,
                on_events=on_events,
                on_lost=self._on_lost,
            )
            for prefix, on_events in (
                (keys.state, self._on_state_events),
                (keys.nodes, self._on_node_events),
                (keys.rounds, self._on_join_events),
            )
        ]

    def _set_members(self, round_: int, members: list[str]) -> None:
        self._members, self._member_set, self._members_round = (
            list(members),
            frozenset(members),
            round_,
        )

    def _apply_state(self, state: RoundState, revision: int) -> None:
        """Take ``state`` (written at ``revision``) into the view (lock held)."""
        if revision <= self._state_rev:
            return
        self._state, self._state_rev = state, revision
        if state.status == OPEN and self._open_round != state.round:
            self._open_round = state.round
            self._min_reached_at = None
            self._published = (state.joined, float("-inf"))
            self._lost = []
            if state.previous_round is None:
                self._previous = None
                self._missing = set()
            elif state.previous_round == self._members_round:
                self._previous = self._members
                joined = self._joined.get(state.round, {})
                self._missing = {n for n in self._members if n in self._live and n not in joined}
            else:  # the previous round was decided by another coordinator
                self._needs_resync = True
        elif (
            state.status == COMPLETE
            and self._members_round != state.round
            and self._closing != state.round
        ):
            # Closed by another coordinator: read its ranks. (Not our own close, whose event can
            # arrive on the watch before _close records the members: that read and the re-armed
            # watches were pure waste, once a round.)
            self._needs_resync = True
        self._dirty = True

    def _on_lost(self, reason: str) -> None:
        log.info(
            "etcd-v3: a coordinator watch of run %s was lost (%s); reading again",
            self._settings.run_id,
            reason,
        )
        with self._cond:
            self._needs_resync = True
            self._cond.notify_all()

    def _on_state_events(self, events: list[Any]) -> None:
        delete_event = self._connection.etcd3.events.DeleteEvent
        with self._cond:
            for event in events:
                key = event.key.decode()
                if key == self._keys.coordinator:
                    if (
                        isinstance(event, delete_event)
                        or bytes(event.value) != self.node_id.encode()
                    ):
                        self._stopping = True  # deposed: another node decides from now on
                elif key == self._keys.state and not isinstance(event, delete_event):
                    try:
                        state = RoundState.decode(event.value, key)
                    except RendezvousStateError as exc:
                        log.warning("etcd-v3: ignoring a bad rendezvous state: %s", exc)
                        continue
                    self._apply_state(state, int(event.mod_revision))
            self._cond.notify_all()

    def _on_node_events(self, events: list[Any]) -> None:
        delete_event = self._connection.etcd3.events.DeleteEvent
        prefix = len(self._keys.nodes)
        with self._cond:
            for event in events:
                node = event.key.decode()[prefix:]
                if not isinstance(event, delete_event):
                    self._live[node] = int(event.lease)
                    continue
                self._live.pop(node, None)
                self._missing.discard(node)
                if node in self._member_set:
                    state = self._state
                    if state is not None and state.status == CLOSED:
                        log.info("etcd-v3: node %s left the closed run", node)
                    elif (
                        state is not None
                        and state.status == COMPLETE
                        and state.round == self._members_round
                    ):
                        self._lost.append(node)
            self._dirty = True
            self._cond.notify_all()

    def _on_join_events(self, events: list[Any]) -> None:
        delete_event = self._connection.etcd3.events.DeleteEvent
        prefix = len(self._keys.rounds)
        with self._cond:
            for event in events:
                round_text, _, node = event.key.decode()[prefix:].partition("/")
                try:
                    round_ = int(round_text)
                except ValueError:
                    continue
                if isinstance(event, delete_event):
                    nodes = self._joined.get(round_)
                    if nodes is not None:
                        nodes.pop(node, None)
                        if not nodes:
                            del self._joined[round_]
                else:
                    self._joined.setdefault(round_, {})[node] = int(event.create_revision)
                    if round_ == self._open_round:
                        self._missing.discard(node)
            self._dirty = True
            self._cond.notify_all()

    # -- decisions --------------------------------------------------------------------------------

    def _step(self) -> None:
        with self._cond:
            state, revision = self._state, self._state_rev
            if state is None or state.status == CLOSED or self._needs_resync:
                return
            if state.status == COMPLETE:
                lost = list(self._lost)
                if not lost:
                    return
            else:
                lost = []
        if state.status == COMPLETE:
            self._open_next(state, revision, lost)
            return
        self._step_open(state, revision)

    def _step_open(self, state: RoundState, revision: int) -> None:
        settings = self._settings
        now = time.monotonic()
        with self._cond:
            joined = self._joined.get(state.round, {})
            count = len(joined)
            first_round = state.previous_round is None
            if count >= settings.min_nodes and self._min_reached_at is None:
                self._min_reached_at = now
            waited = 0.0 if self._min_reached_at is None else now - self._min_reached_at
            ready = close_ready(
                joined=count,
                first_round=first_round,
                missing_previous=len(self._missing),
                waited=waited,
                settings=settings,
            )
            participants: list[str] = []
            if ready:
                ordered = sorted(joined, key=joined.__getitem__)
                live_joined = [n for n in ordered if n in self._live]
                ordered = order_participants(live_joined, self._previous)
                if first_round and self.node_id in joined:
                    # Any order will do in a first round: this node first, so that rank 0's store
                    # address comes with the close (no separate write to wait for).
                    ordered = [self.node_id, *(n for n in ordered if n != self.node_id)]
                participants = ordered[: settings.max_nodes]
                ready = len(live_joined) == count or close_ready(
                    joined=len(live_joined),
                    first_round=first_round,
                    missing_previous=len(self._missing),
                    waited=waited,
                    settings=settings,
                )
            publish = (
                not ready
                and (count < settings.min_nodes or (first_round and count < settings.max_nodes))
                and count != self._published[0]
            )
            if publish and now - self._published[1] < self._progress_interval / 2:
                self._wake(self._published[1] + self._progress_interval / 2)
                publish = False
            if not ready and first_round and self._min_reached_at is not None:
                self._wake(self._min_reached_at + settings.last_call_timeout)
        if ready:
            self._close(state, revision, participants)
        elif publish:
            self._publish_count(state, revision, count, now)

    def _wake(self, at: float) -> None:
        self._wake_at = min(self._wake_at, at)

    def _guarded(self, compare: list[Any], success: list[Any], what: str) -> etcd_ops.TxnResult:
        """A write guarded by ``compare`` and by this node holding the coordinator key; the
        failure branch reads the state and the coordinator key."""
        conn, keys = self._connection, self._keys
        return etcd_ops.transaction(
            conn,
            [*compare, etcd_ops.value_is(conn, keys.coordinator, self.node_id.encode())],
            success,
            [etcd_ops.get(conn, keys.state), etcd_ops.get(conn, keys.coordinator)],
            what=what,
            deadline=self._deadline,
        )

    def _write_state(
        self, new: RoundState, revision: int, extra: list[Any], what: str
    ) -> int | None:
        """CAS the state from ``revision`` to ``new`` (plus ``extra`` ops); the new revision, or
        ``None`` if the state had changed (the view then takes the current one)."""
        conn, keys = self._connection, self._keys
        value = new.encode()
        result = self._guarded(
            [etcd_ops.mod_is(conn, keys.state, revision)],
            [etcd_ops.put(conn, keys.state, value), *extra],
            what,
        )
        if result.succeeded:
            return result.revision
        current, current_rev = etcd_ops.first_value(result.responses[0])
        holder, _ = etcd_ops.first_value(result.responses[1])
        if holder != self.node_id.encode():
            raise _Deposed
        if current == value:  # our own write, retried after its answer was lost
            return current_rev
        if current is not None:
            with self._cond:
                self._apply_state(RoundState.decode(current, keys.state), current_rev)
        return None

    def _close_writes(self, round_: int, participants: list[str]) -> tuple[int, list[Any]]:
        """The shard count of a close of ``round_`` and the writes that go with it: the rank
        shards, and the deletion of (at most :data:`_MAX_STALE_DELETES`) older rounds' keys."""
        conn, keys = self._connection, self._keys
        shards = shard_count(self._settings.max_nodes)
        ranks: list[dict[str, int]] = [{} for _ in range(shards)]
        for rank, node in enumerate(participants):
            ranks[shard_of(node, shards)][node] = rank
        with self._cond:
            stale = sorted(r for r in self._joined if r < round_)[:_MAX_STALE_DELETES]
        ops = [
            etcd_ops.put(conn, keys.shard(k), encode_shard(round_, shard))
            for k, shard in enumerate(ranks)
        ]
        ops += [etcd_ops.delete_prefix(conn, keys.round_prefix(r)) for r in stale]
        return shards, ops

    def _close(self, state: RoundState, revision: int, participants: list[str]) -> None:
        shards, ops = self._close_writes(state.round, participants)
        master = self._make_master(state.round) if participants[0] == self.node_id else None
        closed = RoundState(
            state.round,
            COMPLETE,
            world_size=len(participants),
            shards=shards,
            master=f"{master.addr}:{master.port}" if master else None,
        )
        with self._cond:
            self._closing = state.round
        new_revision: int | None = None
        try:
            new_revision = self._write_state(closed, revision, ops, "a round close")
        finally:
            with self._cond:
                self._closing = None
                if (
                    self._state is not None
                    and self._state.status == COMPLETE
                    and self._state.round == state.round
                    and self._members_round != state.round
                    and new_revision is None
                ):
                    self._needs_resync = (
                        True  # another coordinator closed it meanwhile: read its ranks
                    )
        if new_revision is None:
            return
        with self._cond:
            self._set_members(state.round, participants)
            self._lost = [m for m in participants if m not in self._live]
            closed.participants = list(participants)
            self._apply_state(closed, new_revision)
        log.info(
            "etcd-v3: round %d of run %s closed with %d node(s)",
            state.round,
            self._settings.run_id,
            len(participants),
        )

    def _open_next(self, state: RoundState, revision: int, lost: list[str]) -> None:
        opened = RoundState(state.round + 1, OPEN, previous_round=state.round)
        new_revision = self._write_state(opened, revision, [], "a new round")
        if new_revision is None:
            with self._cond:
                if self._state is not None and self._state.status == CLOSED:
                    for node in lost:
                        log.info("etcd-v3: node %s left the closed run", node)
                    self._lost = []
            return
        more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
        log.warning(
            "etcd-v3: node %s%s of round %d is gone (lease expired or revoked); opening round %d",
            lost[0],
            more,
            state.round,
            opened.round,
        )
        with self._cond:
            self._apply_state(opened, new_revision)

    def _publish_count(self, state: RoundState, revision: int, count: int, now: float) -> None:
        updated = RoundState(state.round, OPEN, previous_round=state.previous_round, joined=count)
        new_revision = self._write_state(updated, revision, [], "a progress count")
        with self._cond:
            self._published = (count, now)
            if new_revision is not None:
                self._apply_state(updated, new_revision)
