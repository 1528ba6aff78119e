"""Keep many etcd leases alive over one streaming ``LeaseKeepAlive`` call per connection.

etcd's keep-alive is a bidirectional stream: the client sends a lease id whenever the lease
should be renewed and etcd answers with its new TTL. ``etcd3``'s ``refresh_lease`` opens a new
stream for every renewal, and the lease rendezvous used to run one thread per lease doing so.
:class:`LeaseKeeper` holds one stream per connection for every lease registered on it:

* each lease is renewed every ``ttl / 3`` seconds (like etcd's own Go client), so a lease
  survives two lost renewals;
* a renewal whose answer has TTL 0 means etcd no longer has the lease (it expired while this
  process was cut off, or it was revoked): the owner's ``on_expired`` callback is called once,
  on the keeper's reader thread (it must not block), and the lease is dropped;
* when the stream fails (an etcd member died, a leader change, a closed channel), the keeper
  fails over to the next endpoint and reopens it with backoff, spreading the overdue renewals
  over the next second instead of sending them in one burst.

Every renewal is counted as one request (``"a lease keep-alive"``) on the connection. Threads:
one reader per connection plus the sender that gRPC runs for the request stream -- the same for
one lease (a torchrun agent) as for a thousand (a benchmark process simulating a thousand nodes).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rendezvous import jitter
from rendezvous.etcd_client import EtcdConnection, join_stream_thread

log = logging.getLogger(__name__)

KEEP_ALIVE_KIND = "a lease keep-alive"
_SHARED: weakref.WeakKeyDictionary[EtcdConnection, LeaseKeeper] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


@dataclass(slots=True)
class _Kept:
    ttl: int
    on_expired: Callable[[int], None]


class LeaseKeeper:
    """Renews registered leases over one keep-alive stream of ``connection``."""

    def __init__(self, connection: EtcdConnection) -> None:
        self._connection = connection
        self._cond = threading.Condition()
        self._leases: dict[int, _Kept] = {}
        self._due: list[tuple[float, int]] = []  # (when, lease id); stale entries are skipped
        self._next_due: dict[int, float] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._call: Any = None

    @classmethod
    def of(cls, connection: EtcdConnection) -> LeaseKeeper:
        """The keeper shared by everything on ``connection`` (stopped when it closes)."""
        with _SHARED_LOCK:
            keeper = _SHARED.get(connection)
            if keeper is None:
                keeper = _SHARED[connection] = cls(connection)
                connection.add_close_hook(keeper.close)
            return keeper

    @staticmethod
    def interval(ttl: int) -> float:
        """Seconds between two renewals of a lease of ``ttl`` seconds."""
        return max(ttl / 3.0, 0.5)

    def keep(self, lease_id: int, ttl: int, on_expired: Callable[[int], None]) -> None:
        """Renew ``lease_id`` (granted with ``ttl``) until :meth:`forget` or until it expires."""
        with self._cond:
            if self._closed:
                return
            self._leases[lease_id] = _Kept(ttl, on_expired)
            self._schedule(lease_id, time.monotonic() + self.interval(ttl))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="etcd-v3-keepalive", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def forget(self, lease_id: int) -> None:
        """Stop renewing ``lease_id`` (it expires after its TTL unless revoked)."""
        with self._cond:
            self._leases.pop(lease_id, None)
            self._next_due.pop(lease_id, None)

    def kept(self) -> int:
        """How many leases are kept alive."""
        with self._cond:
            return len(self._leases)

    def close(self) -> None:
        """Stop renewing everything and end the stream."""
        with self._cond:
            self._closed = True
            self._leases.clear()
            self._cond.notify_all()
            call = self._call
        if call is not None:
            call.cancel()
        join_stream_thread(self._thread)  # the stream is over before the connection closes

    # -- internals ------------------------------------------------------------------------------

    def _schedule(self, lease_id: int, when: float) -> None:
        self._next_due[lease_id] = when
        heapq.heappush(self._due, (when, lease_id))

    def _requests(self, stream_ended: threading.Event) -> Iterator[Any]:
        """The request stream (run by gRPC's sender thread): each lease when it is due."""
        request_type = self._connection.etcd3.etcdrpc.LeaseKeepAliveRequest
        while True:
            due: list[int] = []
            with self._cond:
                while not due:
                    if self._closed or stream_ended.is_set():
                        return
                    now = time.monotonic()
                    while self._due and self._due[0][0] <= now:
                        when, lease_id = heapq.heappop(self._due)
                        kept = self._leases.get(lease_id)
                        if kept is None or self._next_due.get(lease_id) != when:
                            continue  # forgotten, or rescheduled since
                        due.append(lease_id)
                        self._schedule(lease_id, now + self.interval(kept.ttl))
                    if not due:
                        timeout = self._due[0][0] - now if self._due else None
                        self._cond.wait(timeout if timeout is None else min(timeout, 1.0))
            self._connection.count(KEEP_ALIVE_KIND, len(due))
            for lease_id in due:
                yield request_type(ID=lease_id)

    def _run(self) -> None:
        backoff = 0.05
        while True:
            with self._cond:
                if self._closed:
                    return
            stream_ended = threading.Event()
            client = None
            try:
                client = self._connection.current_client()
                call = client.leasestub.LeaseKeepAlive(
                    self._requests(stream_ended),
                    credentials=client.call_credentials,
                    metadata=client.metadata,
                )
                with self._cond:
                    self._call = call
                for response in call:
                    backoff = 0.05
                    if response.TTL <= 0:
                        self._expired(int(response.ID))
            except Exception as exc:
                with self._cond:
                    if self._closed:
                        return
                log.info("etcd-v3: the lease keep-alive stream failed (%s); reopening", exc)
                if client is not None and self._connection.is_transient(exc):
                    self._connection.fail_over_from(client)
            finally:
                stream_ended.set()
                with self._cond:
                    self._call = None
                    self._cond.notify_all()
            time.sleep(backoff + jitter.uniform(0, backoff))
            backoff = min(backoff * 2, 1.0)
            self._spread_overdue()

    def _spread_overdue(self) -> None:
        """After a broken stream, renew what fell due over the next second, not in one burst."""
        with self._cond:
            now = time.monotonic()
            for lease_id, when in list(self._next_due.items()):
                if when <= now + 0.1:
                    self._schedule(lease_id, now + jitter.uniform(0.0, 1.0))

    def _expired(self, lease_id: int) -> None:
        with self._cond:
            kept = self._leases.pop(lease_id, None)
            self._next_due.pop(lease_id, None)
        if kept is not None:
            try:
                kept.on_expired(lease_id)
            except Exception:
                log.exception("etcd-v3: handling the expiry of lease %x failed", lease_id)
