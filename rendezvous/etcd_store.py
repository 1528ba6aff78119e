"""A ``torch.distributed.Store`` over etcd v3, used as the rendezvous store of ``etcd-v3``.

Keys live under ``{key_prefix}/{run_id}/store/`` and are attached to a renewed etcd lease (the
rendezvous ``ttl``), so an abandoned run's keys expire. Blocking reads (``get``, ``wait``,
``multi_get``) read the key together with the cluster revision and, if it is missing, open an etcd
watch from the next revision: no write can slip between the read and the watch, and the caller
wakes as soon as the key is written -- not on a polling tick. A safety re-read every few seconds
covers a watch stream broken by an etcd restart.

``add`` is a compare-and-swap on the key's revision. It also writes a short-lived marker holding
the result, so that when a response is lost and the call is retried, the retry returns the
recorded result instead of adding twice.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import Store

from rendezvous.etcd_client import EtcdConnection
from rendezvous.leases import RenewedLease

log = logging.getLogger(__name__)

_SAFETY_RECHECK_S = 5.0
_MARKER_TTL_S = 600


def _to_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


class EtcdV3Store(Store):
    """A c10d ``Store`` whose keys are etcd v3 keys under ``prefix``.

    Args:
        connection: the connection to the etcd cluster.
        prefix: the etcd key prefix of this store (no trailing slash needed).
        timeout: how long blocking reads wait; defaults to the c10d default (5 minutes).
        ttl: seconds an untouched key lives.
    """

    def __init__(
        self,
        connection: EtcdConnection,
        prefix: str,
        timeout: timedelta | None = None,
        ttl: int = 7200,
    ) -> None:
        super().__init__()  # required by the pybind11 trampoline
        self._connection = connection
        self._prefix = prefix.rstrip("/") + "/"
        self._ops_prefix = prefix.rstrip("/") + "-ops/"
        self._ttl = ttl
        self._lease = RenewedLease(connection, ttl)
        self._marker_lease = RenewedLease(connection, _MARKER_TTL_S)
        if timeout is not None:
            self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        return self._prefix

    def _key(self, key: str) -> str:
        return self._prefix + key

    # -- writes ---------------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        data, lease = _to_bytes(value), self._lease.lease_id()
        self._connection.call(lambda c: c.put(self._key(key), data, lease=lease), what="a store set")

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError("multi_set: keys and values differ in length")
        txn, lease = self._connection.etcd3.transactions, self._lease.lease_id()
        puts = [txn.Put(self._key(k), _to_bytes(v), lease=lease) for k, v in zip(keys, values, strict=True)]
        self._connection.call(
            lambda c: c.transaction(compare=[], success=puts, failure=[]), what="a store multi_set"
        )

    def _compare_and_put(self, key: str, update: Any) -> bytes:
        """Atomically replace ``key`` by ``update(current_or_None)``; return the new value.

        ``update`` returns the new bytes or ``None`` for "leave as is". Retries lost CAS races.
        A marker keyed by a per-call id records the outcome so a retried call cannot apply twice.
        """
        txn = self._connection.etcd3.transactions
        etcd_key = self._key(key)
        marker = self._ops_prefix + uuid.uuid4().hex
        attempts = 0

        def attempt(client: Any) -> bytes:
            nonlocal attempts
            attempts += 1
            if attempts > 1:  # the previous attempt may have applied before its answer was lost
                recorded, _ = client.get(marker)
                if recorded is not None:
                    return bytes(recorded)
            while True:
                current, meta = client.get(etcd_key)
                new = update(None if current is None else bytes(current))
                if new is None:
                    return bytes(current) if current is not None else b""
                compare = (
                    [txn.Mod(etcd_key) == meta.mod_revision]
                    if current is not None
                    else [txn.Create(etcd_key) == 0]
                )
                succeeded, _ = client.transaction(
                    compare=compare,
                    success=[
                        txn.Put(etcd_key, new, lease=self._lease.lease_id()),
                        txn.Put(marker, new, lease=self._marker_lease.lease_id()),
                    ],
                    failure=[],
                )
                if succeeded:
                    return new  # type: ignore[no-any-return]

        return self._connection.call(attempt, what=f"an atomic update of {key!r}")

    def add(self, key: str, amount: int) -> int:
        def increment(current: bytes | None) -> bytes:
            return str(int(current or b"0") + amount).encode()

        return int(self._compare_and_put(key, increment))

    def append(self, key: str, value: str | bytes) -> None:
        data = _to_bytes(value)
        self._compare_and_put(key, lambda current: (current or b"") + data)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        expected_b, desired_b = _to_bytes(expected), _to_bytes(desired)
        result: dict[str, bytes | None] = {}

        def swap(current: bytes | None) -> bytes | None:
            result["current"] = current
            if (current is None and expected_b == b"") or current == expected_b:
                return desired_b
            return None

        new = self._compare_and_put(key, swap)
        current = result.get("current")
        if current is None and expected_b != b"":
            return expected_b  # TCPStore semantics: a missing key answers with ``expected``
        return new

    def delete_key(self, key: str) -> bool:
        return bool(self._connection.call(lambda c: c.delete(self._key(key)), what="a store delete"))

    # -- reads ----------------------------------------------------------------------------------

    def check(self, keys: list[str]) -> bool:
        txn = self._connection.etcd3.transactions
        compare = [txn.Create(self._key(k)) > 0 for k in keys]
        succeeded, _ = self._connection.call(
            lambda c: c.transaction(compare=compare, success=[], failure=[]), what="a store check"
        )
        return bool(succeeded)

    def num_keys(self) -> int:
        response = self._connection.call(
            lambda c: c.get_prefix_response(self._prefix, keys_only=True, count_only=True),
            what="a store key count",
        )
        return int(response.count)

    def list_keys(self) -> list[str]:
        items = self._connection.call(
            lambda c: list(c.get_prefix(self._prefix, keys_only=True)), what="a store key listing"
        )
        return [meta.key.decode()[len(self._prefix) :] for _, meta in items]

    def get(self, key: str) -> bytes:
        return self._wait_for([key], self._timeout_s())[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_for(keys, self._timeout_s())

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, timeout.total_seconds() if timeout is not None else self._timeout_s())

    def clone(self) -> EtcdV3Store:
        return EtcdV3Store(self._connection, self._prefix, self._timeout(), self._ttl)

    def _timeout(self) -> timedelta:
        # ``timeout`` is a property of the C++ base class that torch's type stubs do not declare.
        return self.timeout  # type: ignore[attr-defined,no-any-return]

    def _timeout_s(self) -> float:
        return float(self._timeout().total_seconds())

    def _wait_for(self, keys: list[str], timeout_s: float) -> list[bytes]:
        """Return the values of ``keys``, waiting for each until ``timeout_s`` has passed.

        Raises:
            LookupError: a key did not appear in time (c10d's ``DistStoreError`` semantics).
        """
        deadline = time.monotonic() + timeout_s
        return [self._wait_for_one(key, deadline, timeout_s) for key in keys]

    def _wait_for_one(self, key: str, deadline: float, timeout_s: float) -> bytes:
        etcd_key = self._key(key)
        while True:
            response = self._connection.call(
                lambda c: c.get_response(etcd_key), what=f"a store read of {key!r}"
            )
            if response.kvs:
                return bytes(response.kvs[0].value)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LookupError(
                    f"etcd store: key {key!r} was not set within {timeout_s:g}s (timeout)"
                )
            self._watch_until_written(etcd_key, response.header.revision + 1, remaining)

    def _watch_until_written(self, etcd_key: str, start_revision: int, remaining: float) -> None:
        woken = threading.Event()

        def on_event(_response: Any) -> None:  # a write, or an error of the watch stream
            woken.set()

        try:
            client = self._connection.client()
            watch_id = client.add_watch_callback(etcd_key, on_event, start_revision=start_revision)
        except Exception as exc:  # etcd briefly unreachable: the caller's next read retries
            log.debug("watch on %s failed (%s); re-reading", etcd_key, exc)
            time.sleep(min(0.2, remaining))
            return
        try:
            woken.wait(min(remaining, _SAFETY_RECHECK_S))
        finally:
            try:
                client.cancel_watch(watch_id)
            except Exception as exc:
                log.debug("cancelling watch %s failed: %s", watch_id, exc)
