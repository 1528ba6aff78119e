"""etcd transactions as the lease rendezvous writes them: raw requests, with the header revision.

``etcd3``'s ``transaction()`` drops the response header, so a writer cannot learn the revision
its write created. :func:`transaction` sends a ``TxnRequest`` built from the small op helpers
below through :meth:`EtcdConnection.call` (retries, failover, counting) and returns whether the
comparisons held, the header revision and the raw responses.

A transaction may be retried after its response was lost; each caller decides from the failure
branch's reads whether its own earlier attempt applied (see :func:`first_value`). A transaction
always writes in one of its branches: etcd before 3.5.5 panics when the client's deadline expires
during a read-only one (etcd-io/etcd#14110); reads are plain ranges (:func:`get_range`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rendezvous.etcd_client import EtcdConnection
from rendezvous.watch_hub import prefix_end

T = TypeVar("T")


REQUIRE_LEADER = ("hasleader", "true")
"""gRPC metadata of every request sent here (etcd's ``WithRequireLeader``): a member that knows it
has no leader, during an election or cut off from the others, refuses the request at once with
``UNAVAILABLE: etcdserver: no leader`` instead of holding it until a deadline, and the retry moves on."""


def request_metadata(client: Any) -> tuple[tuple[str, str], ...]:
    """``client``'s own metadata (its auth token) and :data:`REQUIRE_LEADER`."""
    return (*(client.metadata or ()), REQUIRE_LEADER)


class _Patience:
    """The deadlines of a request's attempts: ``deadline``, and twice the last one after an
    attempt that waited its deadline out, up to the client's ``read_timeout``.

    A short first deadline gets a request stuck behind a dead leader retried on a live member
    soon; doubling it after a timeout keeps an overloaded etcd (every request slow, none lost)
    from being flooded with retries of requests it is still serving. An attempt that failed fast
    (the member refused the connection, or has no leader: :data:`REQUIRE_LEADER`) says nothing
    about etcd's speed and keeps the deadline: the next member gets the same short one, so a
    write sent to a follower during a leader election is retried after one short deadline, not
    after etcd's own 5 s request timeout. Why it is not shortened after a refusal:
    ``docs/design/rendezvous-scale.md`` (Faults).
    """

    TIMED_OUT = 0.9
    """An attempt that failed after this share of its deadline waited it out."""

    def __init__(self, deadline: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._deadline = deadline
        self._clock = clock

    def send(self, client: Any, rpc: Callable[[float], T]) -> T:
        """``rpc(timeout)`` with this attempt's deadline (an attempt of :meth:`EtcdConnection.call`)."""
        longest = float(client.timeout)
        if self._deadline is None:
            return rpc(longest)
        timeout = min(longest, self._deadline)
        started = self._clock()
        try:
            return rpc(timeout)
        except Exception:
            if self._clock() - started >= self.TIMED_OUT * timeout:
                self._deadline = timeout * 2
            raise


@dataclass(frozen=True, slots=True)
class TxnResult:
    """The outcome of :func:`transaction`."""

    succeeded: bool
    revision: int
    """The cluster revision after the transaction (the write's revision if it wrote)."""
    responses: list[Any]
    """The raw ``ResponseOp`` of each op of the branch that ran."""


def transaction(
    connection: EtcdConnection,
    compare: list[Any],
    success: list[Any],
    failure: list[Any] | None = None,
    *,
    what: str,
    kind: str | None = None,
    retry_timeout: float | None = None,
    deadline: float | None = None,
) -> TxnResult:
    """Run one etcd transaction (``compare`` from :func:`mod_is` etc., ops from :func:`put` etc.).

    ``deadline`` is the gRPC deadline of the first attempt (default: the connection's
    ``read_timeout``); see :class:`_Patience` for the next ones.

    Raises:
        RendezvousConnectionError: see :meth:`EtcdConnection.call`.
    """
    request = connection.etcd3.etcdrpc.TxnRequest(
        compare=compare, success=success, failure=failure or []
    )
    send = _kv_send("Txn", request, deadline)
    response = connection.call(send, what=what, kind=kind, retry_timeout=retry_timeout)
    return TxnResult(
        bool(response.succeeded), int(response.header.revision), list(response.responses)
    )


def get_range(
    connection: EtcdConnection,
    key: str,
    *,
    prefix: bool = False,
    what: str,
    deadline: float | None = None,
    retry_timeout: float | None = None,
) -> Any:
    """One range read (the ``RangeResponse``: its ``kvs`` and header revision); ``deadline``: of
    the first attempt; ``retry_timeout``: of all of them (the connection's own by default).

    Never a read-only transaction: etcd before 3.5.5 panics when the client's deadline expires
    while it serves one (etcd-io/etcd#14110), and a short deadline under load is exactly when.
    """
    send = _kv_send("Range", _range_request(connection, key, prefix), deadline)
    return connection.call(send, what=what, retry_timeout=retry_timeout, read=True)


def put_key(
    connection: EtcdConnection,
    key: str,
    value: bytes,
    lease: int = 0,
    *,
    what: str,
    deadline: float | None = None,
) -> int:
    """Put one key; the revision of the write."""
    request = connection.etcd3.etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease)
    return int(connection.call(_kv_send("Put", request, deadline), what=what).header.revision)


def _kv_send(method: str, request: Any, deadline: float | None) -> Callable[[Any], Any]:
    """An attempt (for :meth:`EtcdConnection.call`) that sends ``request`` to the KV service's
    ``method`` (``Txn``, ``Range``, ``Put``) with :class:`_Patience`'s deadlines."""
    patience = _Patience(deadline)

    def send(client: Any) -> Any:
        rpc = getattr(client.kvstub, method)
        return patience.send(
            client,
            lambda timeout: rpc(
                request,
                timeout,
                credentials=client.call_credentials,
                metadata=request_metadata(client),
            ),
        )

    return send


def _range_request(connection: EtcdConnection, key: str, prefix: bool) -> Any:
    """A ``RangeRequest`` for ``key``, or every key under it (``prefix``)."""
    raw = key.encode()
    request = connection.etcd3.etcdrpc.RangeRequest(key=raw)
    if prefix:
        request.range_end = prefix_end(raw)
    return request


def put(connection: EtcdConnection, key: str, value: bytes, lease: int = 0) -> Any:
    rpc = connection.etcd3.etcdrpc
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key.encode(), value=value, lease=lease))


def get(connection: EtcdConnection, key: str, *, prefix: bool = False) -> Any:
    request = _range_request(connection, key, prefix)
    return connection.etcd3.etcdrpc.RequestOp(request_range=request)


def delete_prefix(connection: EtcdConnection, prefix: str) -> Any:
    rpc = connection.etcd3.etcdrpc
    raw = prefix.encode()
    return rpc.RequestOp(
        request_delete_range=rpc.DeleteRangeRequest(key=raw, range_end=prefix_end(raw))
    )


def delete(connection: EtcdConnection, key: str) -> Any:
    rpc = connection.etcd3.etcdrpc
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key.encode()))


def _compare(connection: EtcdConnection, key: str, target: str, result: str, **value: Any) -> Any:
    rpc = connection.etcd3.etcdrpc
    return rpc.Compare(
        key=key.encode(),
        target=getattr(rpc.Compare, target),
        result=getattr(rpc.Compare, result),
        **value,
    )


def mod_is(connection: EtcdConnection, key: str, revision: int) -> Any:
    """``key`` was last written at ``revision`` (0: ``key`` does not exist)."""
    return _compare(connection, key, "MOD", "EQUAL", mod_revision=revision)


def absent(connection: EtcdConnection, key: str) -> Any:
    """``key`` does not exist."""
    return _compare(connection, key, "CREATE", "EQUAL", create_revision=0)


def value_is(connection: EtcdConnection, key: str, value: bytes) -> Any:
    """``key`` holds ``value``."""
    return _compare(connection, key, "VALUE", "EQUAL", value=value)


def range_kvs(response: Any) -> list[Any]:
    """The key-values of a range ``ResponseOp``."""
    return list(response.response_range.kvs)


def first_value(response: Any) -> tuple[bytes | None, int]:
    """``(value, mod_revision)`` of the first key of a range ``ResponseOp`` (``(None, 0)`` if none)."""
    kvs = response.response_range.kvs
    if not kvs:
        return None, 0
    return bytes(kvs[0].value), int(kvs[0].mod_revision)
