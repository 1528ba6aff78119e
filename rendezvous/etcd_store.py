"""A ``torch.distributed.Store`` over etcd v3, used as the rendezvous store of ``etcd-v3``.

Keys live under ``{key_prefix}/{run_id}/store/`` and are attached to a renewed etcd lease (the
rendezvous ``ttl``), so an abandoned run's keys expire. Blocking reads (``get``, ``wait``,
``multi_get``) read the key together with the cluster revision and, if it is missing, open an etcd
watch from the next revision: no write can slip between the read and the watch, and the caller
wakes as soon as the key is written -- not on a polling tick. A safety re-read every few seconds
covers a watch stream broken by an etcd restart. A key that is not set in time raises
:class:`StoreTimeoutError`, a ``torch.distributed.DistStoreError`` like every torch store's.

``add`` is a compare-and-swap on the key's revision. It also writes a short-lived marker holding
the result, so that when a response is lost and the call is retried, the retry returns the
recorded result instead of adding twice.

The store keeps torch's ``Store`` contract directly and behind C++ wrappers such as
``dist.PrefixStore``. torch 2.13's trampoline (``PythonStore`` in
``torch/csrc/distributed/c10d/init.cpp``) dispatches ``set``, ``get``, ``add``, ``compare_set``,
``check``, ``wait``, ``append``, ``multi_get``, ``multi_set``, ``has_extended_api`` and ``clone``
by those names, but the key count and key deletion as ``getNumKeys`` and ``deleteKey``, which this
class therefore also defines. ``list_keys`` and the ``queue_*`` methods are not dispatched at all:
behind a wrapper torch raises ``NotImplementedError`` for them. Check these names when torch is
upgraded (``tests/unit/test_etcd_store_contract.py`` does).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, Store

from rendezvous.etcd_client import EtcdConnection
from rendezvous.leases import RenewedLease

log = logging.getLogger(__name__)

_SAFETY_RECHECK_S = 5.0
_MARKER_TTL_S = 600
_MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: ``multi_set`` and ``check`` send at most this many per request."""

# The trampoline finds a Python override through the live Python object. A clone that only C++
# holds (``PrefixStore.clone()`` returns one) would lose its Python half as soon as Python drops
# it, and every later call would fail with "Not implemented". Clones are therefore kept for the
# life of the process; each is small (it shares its parent's connection and leases), and torch
# clones a store only when it splits a process group.
_KEPT_CLONES: list[EtcdV3Store] = []


class StoreTimeoutError(DistStoreError, LookupError):
    """A key of an :class:`EtcdV3Store` was not set in time.

    A ``torch.distributed.DistStoreError``, the error every torch store raises on a timeout (torch's
    elastic store utilities catch only that), and a ``LookupError``. Python exceptions cross torch's
    C++ wrappers unchanged, so callers of a ``PrefixStore`` over this store see this class too.
    """


def _to_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


def _chunks(items: list[Any], size: int = _MAX_TXN_OPS) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class _Cancellation:
    """Shared by a store and its clones: once cancelled, every wait ends and every read fails."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._waiting: set[threading.Event] = set()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            waiting = list(self._waiting)
        for event in waiting:
            event.set()

    def check(self, key: str) -> None:
        if self._cancelled:
            raise StoreTimeoutError(
                f"etcd store: waiting for key {key!r} was cancelled (the group is abandoned)"
            )

    @contextlib.contextmanager
    def waking(self, event: threading.Event) -> Iterator[None]:
        """While inside, :meth:`cancel` sets ``event``."""
        with self._lock:
            if self._cancelled:
                event.set()
            self._waiting.add(event)
        try:
            yield
        finally:
            with self._lock:
                self._waiting.discard(event)


class EtcdV3Store(Store):
    """A c10d ``Store`` whose keys are etcd v3 keys under ``prefix``.

    Hold a reference to the store while a C++ wrapper (``dist.PrefixStore``) uses it: the wrapper
    keeps only the C++ half, and torch answers "Tried to call pure virtual function" once the
    Python half is gone. Clones need no such care (see :meth:`clone`).

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
        self._cancelled = _Cancellation()
        if timeout is not None:
            self.set_timeout(timeout)

    def cancel(self) -> None:
        """Make every blocking read of this store and its clones, waiting now or later, fail at once
        with :class:`StoreTimeoutError` (any thread): a group being formed on this store is
        abandoned, e.g. because a member died before writing its address."""
        self._cancelled.cancel()

    @property
    def prefix(self) -> str:
        return self._prefix

    def _key(self, key: str) -> str:
        return self._prefix + key

    # -- writes ---------------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        data, lease = _to_bytes(value), self._lease.lease_id()
        self._connection.call(
            lambda c: c.put(self._key(key), data, lease=lease), what="a store set"
        )

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Set ``keys`` to ``values``: atomically up to 128 keys, larger batches in order.

        Raises:
            ValueError: ``keys`` and ``values`` differ in length (nothing is written).
        """
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set: {len(keys)} keys but {len(values)} values; they must match"
            )
        txn, lease = self._connection.etcd3.transactions, self._lease.lease_id()
        puts = [
            txn.Put(self._key(k), _to_bytes(v), lease=lease)
            for k, v in zip(keys, values, strict=True)
        ]
        for chunk in _chunks(puts):
            self._transaction(compare=[], success=chunk, what="a store multi_set")

    def _transaction(self, *, compare: list[Any], success: list[Any], what: str) -> bool:
        succeeded, _ = self._connection.call(
            lambda c: c.transaction(compare=compare, success=success, failure=[]), what=what
        )
        return bool(succeeded)

    def _compare_and_put(self, key: str, update: Callable[[bytes | None], bytes | None]) -> bytes:
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
                    return new

        return self._connection.call(attempt, what=f"an atomic update of {key!r}")

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 if missing) and return the sum.

        Raises:
            ValueError: the key holds something other than an integer (it is left unchanged).
        """
        not_integer: list[bytes] = []

        def increment(current: bytes | None) -> bytes | None:
            not_integer.clear()  # only the value the final attempt saw counts
            try:
                return str(int(current or b"0") + amount).encode()
            except ValueError:
                not_integer.append(current or b"")
                return None

        result = self._compare_and_put(key, increment)
        if not_integer:
            raise ValueError(f"add: store key {key!r} holds {not_integer[-1]!r}, not an integer")
        return int(result)

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to ``key``, creating it if missing (torch's ``append``)."""
        data = _to_bytes(value)
        self._compare_and_put(key, lambda current: (current or b"") + data)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return the value it then holds.

        torch's semantics: a missing key counts as holding ``b""``, and a missing key compared
        with a non-empty ``expected`` is left missing and answers ``expected``.
        """
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
            return expected_b
        return new

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        return bool(
            self._connection.call(lambda c: c.delete(self._key(key)), what="a store delete")
        )

    def deleteKey(self, key: str) -> bool:  # the trampoline's name for delete_key
        """``delete_key`` under the name torch's C++ wrappers call."""
        return self.delete_key(key)

    # -- reads ----------------------------------------------------------------------------------

    def check(self, keys: list[str]) -> bool:
        """Whether every key in ``keys`` exists, without waiting.

        One count-only range per key, not one read-only transaction of comparisons: etcd before
        3.5.5 panics when a client's deadline expires during a read-only transaction
        (etcd-io/etcd#14110).
        """
        rpc = self._connection.etcd3.etcdrpc
        for key in keys:
            request = rpc.RangeRequest(key=self._key(key).encode(), count_only=True)

            def count(client: Any, request: Any = request) -> int:
                response = client.kvstub.Range(
                    request,
                    client.timeout,
                    credentials=client.call_credentials,
                    metadata=client.metadata,
                )
                return int(response.count)

            if not self._connection.call(count, what="a store check", read=True):
                return False
        return True

    def num_keys(self) -> int:
        """The number of keys in this store (like ``HashStore``: no internal keys counted)."""
        response = self._connection.call(
            lambda c: c.get_prefix_response(self._prefix, keys_only=True, count_only=True),
            what="a store key count",
            read=True,
        )
        return int(response.count)

    def getNumKeys(self) -> int:  # the trampoline's name for num_keys
        """``num_keys`` under the name torch's C++ wrappers call."""
        return self.num_keys()

    def list_keys(self) -> list[str]:
        """The keys of this store (direct calls only: torch 2.13's wrappers cannot reach it)."""
        items = self._connection.call(
            lambda c: list(c.get_prefix(self._prefix, keys_only=True)),
            what="a store key listing",
            read=True,
        )
        return [meta.key.decode()[len(self._prefix) :] for _, meta in items]

    def has_extended_api(self) -> bool:
        """True: ``append``, ``multi_get`` and ``multi_set`` keep torch's semantics."""
        return True

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to be set.

        Raises:
            StoreTimeoutError: the key was not set in time.
        """
        return self._wait_for([key], self._timeout_s())[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, waiting up to the store's timeout (in all) for them.

        Raises:
            StoreTimeoutError: a key was not set in time.
        """
        return self._wait_for(keys, self._timeout_s())

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until every key in ``keys`` is set, up to ``timeout`` or the store's timeout.

        Raises:
            StoreTimeoutError: a key was not set in time.
        """
        self._wait_for(keys, timeout.total_seconds() if timeout is not None else self._timeout_s())

    def clone(self) -> EtcdV3Store:
        """A new store on the same keys, sharing this one's connection and leases.

        The clone has its own timeout (a copy of this one's) and stays usable when this store,
        or the wrapper it was cloned through, is gone.
        """
        twin = EtcdV3Store(self._connection, self._prefix, self._timeout(), self._ttl)
        twin._lease, twin._marker_lease, twin._cancelled = (
            self._lease,
            self._marker_lease,
            self._cancelled,
        )
        _KEPT_CLONES.append(twin)
        return twin

    def _timeout(self) -> timedelta:
        # ``timeout`` is a property of the C++ base class that torch's type stubs do not declare.
        return self.timeout  # type: ignore[attr-defined,no-any-return]

    def _timeout_s(self) -> float:
        return float(self._timeout().total_seconds())

    def _wait_for(self, keys: list[str], timeout_s: float) -> list[bytes]:
        """Return the values of ``keys``, waiting for each until ``timeout_s`` has passed.

        Raises:
            StoreTimeoutError: a key did not appear in time.
        """
        deadline = time.monotonic() + timeout_s
        return [self._wait_for_one(key, deadline, timeout_s) for key in keys]

    def _wait_for_one(self, key: str, deadline: float, timeout_s: float) -> bytes:
        etcd_key = self._key(key)
        while True:
            self._cancelled.check(key)
            response = self._connection.call(
                lambda c: c.get_response(etcd_key), what=f"a store read of {key!r}", read=True
            )
            if response.kvs:
                return bytes(response.kvs[0].value)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeoutError(
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
            with self._cancelled.waking(woken):
                woken.wait(min(remaining, _SAFETY_RECHECK_S))
        finally:
            try:
                client.cancel_watch(watch_id)
            except Exception as exc:
                log.debug("cancelling watch %s failed: %s", watch_id, exc)
