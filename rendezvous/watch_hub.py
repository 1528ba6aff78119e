"""Many etcd watches over one ``Watch`` stream per connection, resumed after a failover.

Every watch a rendezvous node needs (its round state, its rank shard; the coordinator's node and
join keys) is a real etcd watcher with its own watch id, so etcd does the same work per node as
it would for one node per machine. What :class:`WatchHub` adds over ``etcd3``'s watcher:

* **No serialised creation.** ``etcd3`` sends one create request at a time and waits for its
  answer. The hub pipelines them: etcd answers the create requests of a stream in the order it
  received them, so the n-th "created" answer belongs to the n-th request sent.
* **Resumption instead of resynchronisation.** Each watch remembers the revision after the last
  event it delivered. When the stream fails (a member killed, a leader change, a closed channel)
  the hub fails over to the next endpoint and re-creates every watch from that revision: no event
  is lost or delivered twice, and its owner never notices. Only a watch whose revision has been
  compacted away is reported lost (``on_lost``); its owner must read again and watch anew.
* Callbacks run on the hub's reader thread, in revision order per watch, and must not block.

Create and cancel requests are counted on the connection (``"a watch create"``, ``"a watch
cancel"``); delivered events in :attr:`WatchHub.events`.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from rendezvous import jitter
from rendezvous.etcd_client import EtcdConnection, join_stream_thread

log = logging.getLogger(__name__)

_SHARED: weakref.WeakKeyDictionary[EtcdConnection, WatchHub] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()
_END = object()


def describe_all() -> list[str]:
    """:meth:`WatchHub.describe` of every hub in this process."""
    with _SHARED_LOCK:
        hubs = list(_SHARED.values())
    return [hub.describe() for hub in hubs]


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range or watch cover every key starting with ``prefix``."""
    raw = bytearray(prefix)
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"
    raw[-1] += 1
    return bytes(raw)


class HubWatch:
    """One watch of a :class:`WatchHub`; :meth:`cancel` ends it."""

    def __init__(
        self,
        hub: WatchHub,
        key: bytes,
        range_end: bytes | None,
        start_revision: int,
        on_events: Callable[[list[Any]], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self._hub = hub
        self.key, self.range_end = key, range_end
        self.next_revision = start_revision
        """The revision the watch resumes from: one past the last event delivered."""
        self.on_events, self.on_lost = on_events, on_lost
        self.watch_id: int | None = None
        self.cancelled = False

    def cancel(self) -> None:
        """Stop delivering events (idempotent)."""
        self._hub._cancel(self)


class WatchHub:
    """Multiplexes watches of ``connection`` over one resumable stream."""

    def __init__(self, connection: EtcdConnection) -> None:
        self._connection = connection
        self._etcd3 = connection.etcd3
        self._lock = threading.Lock()
        self._active: set[HubWatch] = set()
        self._by_id: dict[int, HubWatch] = {}
        self._pending: collections.deque[HubWatch] = collections.deque()
        self._outbox: queue.Queue[Any] | None = None  # requests for the current stream
        self._thread: threading.Thread | None = None
        self._closed = False
        self._call: Any = None
        self.events = 0
        """Events delivered to callbacks (all watches)."""
        self.last_failure: float | None = None
        """``time.monotonic()`` of the stream's last failure (etcd away, a failover), if any."""

    @classmethod
    def of(cls, connection: EtcdConnection) -> WatchHub:
        """The hub shared by everything on ``connection`` (stopped when it closes)."""
        with _SHARED_LOCK:
            hub = _SHARED.get(connection)
            if hub is None:
                hub = _SHARED[connection] = cls(connection)
                connection.add_close_hook(hub.close)
            return hub

    def watch(
        self,
        key: str | bytes,
        *,
        start_revision: int,
        on_events: Callable[[list[Any]], None],
        on_lost: Callable[[str], None],
        prefix: bool = False,
    ) -> HubWatch:
        """Deliver the events on ``key`` (or every key under it with ``prefix``) from
        ``start_revision`` on; ``on_lost(reason)`` once if they can no longer be delivered.

        Returns at once; the events from ``start_revision`` arrive once etcd created the watch.
        """
        if start_revision <= 0:
            raise ValueError(f"start_revision: must be > 0, got {start_revision}")
        raw = key.encode() if isinstance(key, str) else bytes(key)
        watch = HubWatch(
            self, raw, prefix_end(raw) if prefix else None, start_revision, on_events, on_lost
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("the etcd connection of this watch is closed")
            self._active.add(watch)
            if self._outbox is not None:
                self._send_create(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="etcd-v3-watch", daemon=True)
                self._thread.start()
        return watch

    def describe(self) -> str:
        """One line on the hub's state, for a diagnostic dump: its watches (active, awaiting
        creation, created), the events delivered, the stream, and its last failure."""
        with self._lock:
            stream = (
                "none" if self._call is None else "active" if self._call.is_active() else "ended"
            )
            failure = (
                "never"
                if self.last_failure is None
                else f"{time.monotonic() - self.last_failure:.1f} s ago"
            )
            return (
                f"endpoint {self._connection.endpoint}, {len(self._active)} active, {len(self._pending)} awaiting "
                f"creation, {len(self._by_id)} created, {self.events} events delivered, stream {stream}, "
                f"last failure {failure}"
            )

    def close(self) -> None:
        """End every watch and the stream."""
        with self._lock:
            self._closed = True
            self._active.clear()
            outbox, call = self._outbox, self._call
        if outbox is not None:
            outbox.put(_END)
        if call is not None:
            call.cancel()
        join_stream_thread(self._thread)  # the stream is over before the connection closes

    # -- internals ------------------------------------------------------------------------------

    def _cancel(self, watch: HubWatch) -> None:
        with self._lock:
            if watch.cancelled:
                return
            watch.cancelled = True
            self._active.discard(watch)
            if (
                watch.watch_id is not None
                and self._by_id.pop(watch.watch_id, None) is watch
                and self._outbox is not None
            ):
                rpc = self._etcd3.etcdrpc
                self._outbox.put(
                    rpc.WatchRequest(cancel_request=rpc.WatchCancelRequest(watch_id=watch.watch_id))
                )
                self._connection.count("a watch cancel")

    def _send_create(self, watch: HubWatch) -> None:
        """Queue ``watch``'s create request on the current stream (lock held)."""
        rpc = self._etcd3.etcdrpc
        create = rpc.WatchCreateRequest(key=watch.key, start_revision=watch.next_revision)
        if watch.range_end is not None:
            create.range_end = watch.range_end
        if self._outbox is None:
            return  # no stream now: the next one creates every active watch
        self._pending.append(watch)
        self._outbox.put(rpc.WatchRequest(create_request=create))
        self._connection.count("a watch create")

    @staticmethod
    def _requests(outbox: queue.Queue[Any]) -> Iterator[Any]:
        while True:
            request = outbox.get()
            if request is _END:
                return
            yield request

    def _run(self) -> None:
        backoff = 0.05
        while True:
            outbox: queue.Queue[Any] = queue.Queue()
            client = None
            with self._lock:
                if self._closed:
                    return
                self._outbox, self._by_id, self._pending = outbox, {}, collections.deque()
                for watch in list(self._active):
                    watch.watch_id = None
                    self._send_create(watch)
            try:
                client = self._connection.current_client()
                stub = self._etcd3.etcdrpc.WatchStub(client.channel)
                call = stub.Watch(
                    self._requests(outbox),
                    credentials=client.call_credentials,
                    metadata=client.metadata,
                )
                with self._lock:
                    self._call = call
                for response in call:
                    backoff = 0.05
                    self._handle(response)
            except Exception as exc:
                with self._lock:
                    if self._closed:
                        return
                self.last_failure = time.monotonic()
                log.info("etcd-v3: the watch stream failed (%s); resuming its watches", exc)
                if client is not None and self._connection.is_transient(exc):
                    self._connection.fail_over_from(client)
            finally:
                outbox.put(_END)
                with self._lock:
                    self._outbox, self._call = None, None
            time.sleep(backoff + jitter.uniform(0, backoff))
            backoff = min(backoff * 2, 1.0)

    def _handle(self, response: Any) -> None:
        lost: tuple[HubWatch, str] | None = None
        watch: HubWatch | None
        with self._lock:
            if response.created:
                watch = self._pending.popleft() if self._pending else None
                if watch is None:
                    return
                if response.canceled:
                    lost = (watch, response.cancel_reason or "refused by etcd")
                else:
                    watch.watch_id = int(response.watch_id)
                    if watch.cancelled and self._outbox is not None:
                        rpc = self._etcd3.etcdrpc
                        self._outbox.put(
                            rpc.WatchRequest(
                                cancel_request=rpc.WatchCancelRequest(watch_id=watch.watch_id)
                            )
                        )
                        self._connection.count("a watch cancel")
                    elif not watch.cancelled:
                        self._by_id[watch.watch_id] = watch
            elif response.canceled:
                watch = self._by_id.pop(int(response.watch_id), None)
                if watch is not None and not watch.cancelled:
                    reason = (
                        f"revision {watch.next_revision} was compacted (now {response.compact_revision})"
                        if response.compact_revision
                        else response.cancel_reason or "cancelled by etcd"
                    )
                    lost = (watch, reason)
            watch = (
                None
                if response.created or response.canceled
                else self._by_id.get(int(response.watch_id))
            )
        if lost is not None:
            lost_watch, reason = lost
            with self._lock:
                self._active.discard(lost_watch)
                lost_watch.cancelled = True
            lost_watch.on_lost(reason)
            return
        if watch is None or not response.events:
            return
        events = [self._wrap(event) for event in response.events]
        watch.next_revision = int(response.events[-1].kv.mod_revision) + 1
        self.events += len(events)
        if not watch.cancelled:
            watch.on_events(events)

    def _wrap(self, event: Any) -> Any:
        module = self._etcd3.events
        return (module.DeleteEvent if event.type == 1 else module.PutEvent)(event)
