"""A lazily granted, cheaply renewed etcd lease shared by the keys one process writes."""

from __future__ import annotations

import threading
import time

from rendezvous.etcd_client import EtcdConnection


class RenewedLease:
    """An etcd lease, granted lazily and renewed at most every ``ttl / 4``."""

    def __init__(self, connection: EtcdConnection, ttl: int) -> None:
        self._connection = connection
        self._ttl = ttl
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._renewed_at = 0.0

    def lease_id(self) -> int:
        with self._lock:
            now = time.monotonic()
            if self._lease_id is not None and now - self._renewed_at < self._ttl / 4:
                return self._lease_id
            if self._lease_id is not None:
                remaining = self._connection.call(
                    lambda c: list(c.refresh_lease(self._lease_id))[0].TTL, what="a lease renewal"
                )
                if remaining > 0:
                    self._renewed_at = now
                    return self._lease_id
            lease = self._connection.call(lambda c: c.lease(self._ttl), what="a lease grant")
            self._lease_id, self._renewed_at = int(lease.id), now
            return self._lease_id
