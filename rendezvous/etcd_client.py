"""A small, retrying, failing-over connection to an etcd v3 cluster.

Every call to etcd made by this package goes through :meth:`EtcdConnection.call`, which is the
one place where

* transient faults (gRPC ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED``, a leader change, an etcd
  restart, an expired auth token) are retried with tenacity -- exponential backoff with jitter,
  bounded by a total deadline (``retry_timeout``) shorter than the rendezvous timeouts -- and each
  retry moves to the next endpoint of the cluster and is logged once with its cause;
* permanent faults (wrong password, permission denied, invalid argument, bad TLS material) fail
  at once;
* everything is translated into torch's ``RendezvousConnectionError`` /
  ``RendezvousStateError`` with ``raise ... from exc``.

Callers must make their writes idempotent under retry (compare-and-swap on a revision): a write
whose response was lost is retried, and the retry must notice that the first attempt applied.

Requests go to etcd's leader (:mod:`rendezvous.etcd_leader`), streams (watches, keep-alives) to
the connection's home member: a request a follower forwards is lost without a word if the leader
dies, one sent to the leader fails at once and is retried. A failed request drops the belief
about the leader, not the home member; a failed stream or leader lookup moves the home.

One connection may serve many threads (a process's rendezvous handler, its store, its lease
keep-alive and watch streams; a benchmark's hundreds of simulated nodes). A failed attempt moves
to the next endpoint only if the client it used is still the current one, so that a hundred
threads failing together on a dead member fail over once, not a hundred times. Every request is
counted, by kind (:attr:`EtcdConnection.request_counts`), for benchmarks and tests.

Where the cluster is and how to authenticate (:class:`EtcdClientConfig`, :func:`parse_endpoints`)
is parsed in :mod:`rendezvous.etcd_config`, which imports neither gRPC nor torch; its names are
re-exported here.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from rendezvous import grpc_compat
from rendezvous._protobuf_compat import import_etcd3
from rendezvous.etcd_config import (  # noqa: F401 (re-exported: the settings live there)
    DEFAULT_PORT,
    Endpoint,
    EtcdClientConfig,
    check_security,
    parse_endpoints,
    read_secret_file,
)
from rendezvous.etcd_leader import (
    LeaderBelief,
    LeaderRoute,
    LeaderUnknownError,
    MemberStatus,
    member_status,
)
from rendezvous.jitter import wait_jitter

log = logging.getLogger(__name__)

T = TypeVar("T")

STREAM_STOP_BOUND_S = 2.0
"""Seconds :meth:`EtcdConnection.close` waits for each stream thread (watch, keep-alive) to end."""

_RETIRE_AFTER_S = 60.0
"""A client replaced by a failover is closed this long after (at a later failover or close)."""

# gRPC status codes that may go away by themselves: retry, on the next endpoint.
_TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _grpc_code(exc: BaseException) -> grpc.StatusCode | None:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        try:
            return exc.code()  # type: ignore[no-any-return]
        except Exception:  # a half-initialised RpcError
            return None
    return None


NOT_SENT = "not sent (no connection)"
"""The :attr:`EtcdConnection.request_counts` kind of attempts that never reached a member: its
address refused the connection (a dead member's process); the retry went elsewhere."""


def _never_sent(exc: BaseException) -> bool:
    return _grpc_code(exc) == grpc.StatusCode.UNAVAILABLE and "failed to connect" in _describe(exc)


def _describe(exc: BaseException) -> str:
    # etcd3 replaces a gRPC error by its own bare exception ("ConnectionFailedError: etcd
    # connection failed"); the gRPC error it replaced says why, e.g. "Tls handshake failed ...
    # CERTIFICATE_VERIFY_FAILED" for a wrong CA.
    if not isinstance(exc, grpc.RpcError) and isinstance(exc.__context__, grpc.RpcError):
        exc = exc.__context__
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "details"):
        try:
            return f"{exc.code().name}: {exc.details()}"
        except Exception:
            pass
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@dataclass(slots=True)
class _Attempt:
    """What a :meth:`EtcdConnection.call`'s latest attempt used, for the retry to move away from:
    its client, the leader belief that chose it, and the kind it counted (``None``: it failed
    before sending its request)."""

    client: Any = None
    belief: LeaderBelief | None = None
    counted: str | None = None


class EtcdConnection:
    """A thread-safe handle on an etcd cluster with retries and endpoint failover.

    Args:
        config: where and how to connect.
        sleep: injected into tenacity so that tests need not wait.
        route_to_leader: send requests to the leader (:class:`LeaderRoute`); ``False``: to the
            home member, as streams.
    """

    def __init__(
        self,
        config: EtcdClientConfig,
        *,
        sleep: Callable[[float], None] = time.sleep,
        route_to_leader: bool = True,
    ):
        self._etcd3 = import_etcd3()
        self.config = config
        self._sleep = sleep
        self._lock = threading.Lock()
        self._index = 0
        self._client: Any = None
        self._is_transient = self._make_transient_predicate()
        self._count_lock = threading.Lock()
        self.requests = 0
        """Requests sent to etcd (each attempt counts; each message on a keep-alive or watch
        stream too): for benchmarks and metrics."""
        self.request_counts: Counter[str] = Counter()
        """:attr:`requests` by kind (the ``kind`` or ``what`` of :meth:`call`), and the attempts
        that never reached etcd under :data:`NOT_SENT`."""
        self._close_hooks: list[Callable[[], None]] = []
        self._retired: list[tuple[float, Any]] = []  # (when, client) replaced by a failover
        self._route: LeaderRoute | None = (
            LeaderRoute(len(config.endpoints), self._member_status) if route_to_leader else None
        )
        self._side_clients: dict[
            int, Any
        ] = {}  # endpoint index -> client, for the leader's requests
        _OPEN.add(self)

    # -- public ---------------------------------------------------------------------------------

    @property
    def endpoint(self) -> Endpoint:
        """The endpoint currently in use."""
        return self.config.endpoints[self._index]

    @property
    def leader_endpoint(self) -> Endpoint | None:
        """The endpoint requests go to now, if a leader was found among the configured ones."""
        belief = self._route.belief if self._route is not None else None
        return (
            None if belief is None or belief.index is None else self.config.endpoints[belief.index]
        )

    @property
    def etcd3(self) -> Any:
        """The imported ``etcd3`` module (its ``transactions`` helpers build compare/ops)."""
        return self._etcd3

    def call(
        self,
        operation: Callable[[Any], T],
        *,
        what: str,
        retry_timeout: float | None = None,
        kind: str | None = None,
        read: bool = False,
    ) -> T:
        """Run ``operation(client)`` with retries; return its result.

        ``operation`` gets the leader's client, or with ``read`` the home member's: a follower
        holds a linearizable read until a new leader confirms it, it does not lose it, and reads
        spread over the members. ``retry_timeout`` overrides the configured retry budget for this
        call (e.g. a short one at interpreter exit). ``kind`` names the request in
        :attr:`request_counts` (default: ``what``, which is also the text of errors and retry
        warnings).

        Raises:
            RendezvousConnectionError: etcd stayed unreachable for ``retry_timeout`` seconds, or
                refused the request for a reason a retry cannot fix (auth, permission, TLS).
        """
        budget = self.config.retry_timeout if retry_timeout is None else retry_timeout
        used = _Attempt()

        def attempt() -> T:
            home_index, client = self._home()
            used.client, used.belief, used.counted = client, None, None
            if not read and self._route is not None:
                belief = self._route.find(
                    home_index, client, self._client_for, self.config.read_timeout
                )
                if belief.index is not None:
                    client = self._client_for(belief.index)
                used.client, used.belief = client, belief
            self.count(kind or what)
            used.counted = kind or what
            result = operation(client)
            self._observe_term(result)
            return result

        retrying = Retrying(
            retry=retry_if_exception(self._is_transient),
            # Exponential backoff plus jitter (composed: works with every tenacity >= 8.2).
            wait=wait_exponential(multiplier=0.05, max=1.0) + wait_jitter(0, 0.1),
            stop=stop_after_delay(budget),
            before_sleep=self._before_retry(what, used),
            sleep=self._sleep,
            reraise=True,
        )
        try:
            result = retrying(attempt)
        except RendezvousConnectionError:
            raise
        except Exception as exc:
            if self._is_transient(exc):
                raise RendezvousConnectionError(
                    f"etcd at {self._endpoints_text()} did not answer {what} within "
                    f"{budget:g}s ({_describe(exc)})"
                ) from exc
            raise RendezvousConnectionError(
                f"etcd at {self.endpoint} refused {what}: {_describe(exc)}"
            ) from exc
        _OUTAGES.answered(self._endpoints_text())
        return result

    def count(self, kind: str, n: int = 1) -> None:
        """Count ``n`` requests of ``kind`` (stream messages are counted by their owners)."""
        with self._count_lock:
            self.requests += n
            self.request_counts[kind] += n

    def client(self) -> Any:
        """The raw ``etcd3`` client of the current endpoint (for watches), connecting if needed."""
        return self.call(lambda client: client, what="connect", read=True)

    def current_client(self) -> Any:
        """The raw client of the current endpoint, connecting if needed; no retry, not counted.

        Raises:
            grpc.RpcError, etcd3 errors: connecting (authenticating) failed.
        """
        return self._home()[1]

    def fail_over_from(self, client: Any) -> None:
        """Move to the next endpoint if ``client`` is still the current one (a stream on it
        failed); otherwise someone already moved on."""
        self._fail_over(client)

    def is_transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a fault that a retry on another endpoint may fix."""
        return self._is_transient(exc)

    def add_close_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when the connection is closed (streams that live on it stop)."""
        with self._lock:
            self._close_hooks.append(hook)

    def check(self) -> None:
        """Fail fast (within ``retry_timeout``) if etcd cannot be reached or refuses us."""
        self.call(lambda client: client.status(), what="a status request", read=True)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            hooks, self._close_hooks = self._close_hooks, []
            retired, self._retired = [c for _, c in self._retired], []
            retired += self._side_clients.values()
            self._side_clients = {}
        for hook in hooks:
            try:
                hook()
            except Exception as exc:  # a stream that fails to stop must not keep the channel open
                log.debug("closing a stream of the etcd connection failed: %s", exc)
        for old in [client, *retired]:
            if old is not None:
                with contextlib.suppress(Exception):
                    old.close()
        for old in [client, *retired]:  # etcd3's own watch thread ends once its channel closed
            watcher = getattr(old, "watcher", None)
            join_stream_thread(getattr(watcher, "_callback_thread", None))
        _OPEN.discard(self)

    # -- internals ------------------------------------------------------------------------------

    def _endpoints_text(self) -> str:
        return ",".join(str(e) for e in self.config.endpoints)

    def _make_transient_predicate(self) -> Callable[[BaseException], bool]:
        exceptions = self._etcd3.exceptions
        transient_types = (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError)

        def is_transient(exc: BaseException) -> bool:
            if isinstance(exc, (*transient_types, LeaderUnknownError)):
                return True
            if isinstance(exc, ValueError) and "closed channel" in str(exc):
                return True  # another thread failed over and closed the client this one used
            code = _grpc_code(exc)
            if code in _TRANSIENT_CODES:
                return True
            if code == grpc.StatusCode.CANCELLED and "Channel closed" in _describe(exc):
                return True  # in flight when another thread's failover closed the channel
            if "too many requests" in _describe(exc):
                return True  # etcd's back-pressure: its apply lags its commits by 5,000 entries
            # An expired simple auth token: reconnecting authenticates again.
            return code == grpc.StatusCode.UNAUTHENTICATED and "auth token" in _describe(exc)

        return is_transient

    def _before_retry(self, what: str, used: _Attempt) -> Callable[[RetryCallState], None]:
        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            if exc is not None and used.counted is not None and _never_sent(exc):
                self._uncount(used.counted)
            failed = self._endpoint_of(used.client)
            self._after_failure(used, exc)
            detail = _describe(exc) if exc else "?"
            _OUTAGES.failed(self._endpoints_text(), f"{what}: {detail}", self.config.retry_timeout)
            log.debug(
                "%s to etcd failed on %s (%s); retry %d in %.2fs",
                what, failed, detail, state.attempt_number, state.upcoming_sleep,
            )  # fmt: skip

        return before_sleep

    def _after_failure(self, used: _Attempt, exc: BaseException | None) -> None:
        """Move away from what an attempt failed on: the leader belief it used (asked again next
        time) and, if it failed on the home member's client, the home member. No leader known
        moves nothing: the home member answered (an election), or another thread's lookup failed
        and that thread moves on."""
        if isinstance(exc, LeaderUnknownError):
            return
        if used.belief is not None and self._route is not None:
            self._route.forget(used.belief)
            if self._side_index(used.client) is not None:
                self._renew_if_token_expired(used.client, exc)
                return  # the home member's streams are fine
        self._fail_over(used.client)

    def _uncount(self, kind: str) -> None:
        """Move one request of ``kind`` to :data:`NOT_SENT`: it never reached etcd."""
        with self._count_lock:
            self.requests -= 1
            self.request_counts[kind] -= 1
            self.request_counts[NOT_SENT] += 1

    def _side_index(self, client: Any) -> int | None:
        """The endpoint index of side client ``client``; ``None`` for the home client."""
        with self._lock:
            return next(
                (index for index, side in self._side_clients.items() if side is client), None
            )

    def _renew_if_token_expired(self, client: Any, exc: BaseException | None) -> None:
        """Retire side client ``client`` if ``exc`` says its auth token expired: the next request
        connects (authenticates) again."""
        if exc is None or _grpc_code(exc) != grpc.StatusCode.UNAUTHENTICATED:
            return
        index = self._side_index(client)
        with self._lock:
            if index is not None and self._side_clients.get(index) is client:
                del self._side_clients[index]
                self._retired.append((time.monotonic(), client))
        self._close_expired()

    def _endpoint_of(self, client: Any) -> Endpoint:
        index = self._side_index(client)
        return self.endpoint if index is None else self.config.endpoints[index]

    def _fail_over(self, failed_client: Any = None) -> None:
        now = time.monotonic()
        with self._lock:
            if (
                failed_client is not None
                and self._client is not None
                and self._client is not failed_client
            ):
                return  # another thread has already moved on from the client that failed
            client, self._client = self._client, None
            self._index = (self._index + 1) % len(self.config.endpoints)
            # The old client is not closed at once: other threads' calls and the streams on it
            # (watches, keep-alives) may be fine -- a deadline exceeded under load is no dead
            # member -- and closing it would break them all. It is closed a while later.
            if client is not None:
                self._retired.append((now, client))
        self._close_expired()

    def _close_expired(self) -> None:
        """Close the clients retired more than :data:`_RETIRE_AFTER_S` ago."""
        now = time.monotonic()
        with self._lock:
            expired = [c for at, c in self._retired if now - at > _RETIRE_AFTER_S]
            self._retired = [(at, c) for at, c in self._retired if now - at <= _RETIRE_AFTER_S]
        for old in expired:
            try:
                old.close()
            except Exception as exc:  # closing a broken channel must not hide the real error
                log.debug("closing etcd client failed: %s", exc)

    def _home(self) -> tuple[int, Any]:
        """The home member's endpoint index and client, connecting if needed."""
        with self._lock:
            if self._client is None:
                self._client = self._connect(self.config.endpoints[self._index])
            return self._index, self._client

    def _client_for(self, index: int) -> Any:
        """A client of endpoint ``index``: the home client if that is the home, else a side client
        kept for as long as the connection (gRPC reconnects it when its member comes back)."""
        with self._lock:
            if index == self._index and self._client is not None:
                return self._client
            client = self._side_clients.get(index)
        if client is not None:
            return client
        # Connected outside the lock: with auth, connecting is a request, and a member that does
        # not answer must not stall the home member's callers and streams.
        fresh = self._connect(self.config.endpoints[index])
        with self._lock:
            client = self._side_clients.setdefault(index, fresh)
        if client is not fresh:
            with contextlib.suppress(Exception):
                fresh.close()  # another thread connected first
        return client

    def _observe_term(self, response: Any) -> None:
        """Tell the leader route the raft term of a raw etcd response (every response header
        carries it; results of ``etcd3``'s own helpers carry none)."""
        if self._route is None:
            return
        term = getattr(getattr(response, "header", None), "raft_term", None)
        if isinstance(term, int):
            self._route.observe_term(term)

    def _member_status(self, client: Any, timeout: float) -> MemberStatus:
        """A counted ``Status``: the leader route's only request."""
        self.count("leader lookup")
        try:
            return member_status(client, timeout)
        except Exception as exc:
            if _never_sent(exc):
                self._uncount("leader lookup")
            self._renew_if_token_expired(client, exc)
            raise

    def _connect(self, endpoint: Endpoint) -> Any:
        config = self.config
        grpc_compat.quiet_stream_waits()  # its streams are read off the main thread

        def read(path: str | None) -> str | None:
            return path  # etcd3 reads the files itself; existence was validated in config

        try:
            client = self._etcd3.client(
                host=endpoint.host,
                port=endpoint.port,
                ca_cert=read(config.ca_cert) if config.protocol == "https" else None,
                cert_key=read(config.ssl_cert_key),
                cert_cert=read(config.ssl_cert),
                timeout=config.read_timeout,
                user=config.user,
                password=config.password,
                grpc_options=[
                    ("grpc.keepalive_time_ms", 10_000),
                    ("grpc.keepalive_timeout_ms", 5_000),
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1_000),
                ],
            )
        except grpc.RpcError:
            raise  # e.g. UNAVAILABLE while authenticating: classified by the retry predicate
        except OSError as exc:
            raise RendezvousConnectionError(f"cannot read TLS files for etcd: {exc}") from exc
        if client.call_credentials is not None and not client.uses_secure_channel:
            # gRPC refuses call credentials on a plaintext channel; etcd3 also sends the auth
            # token as request metadata, which is all etcd needs.
            client.call_credentials = None
        client.watcher = _watcher_class(self._etcd3)(
            self._etcd3.etcdrpc.WatchStub(client.channel),
            timeout=client.timeout,
            call_credentials=client.call_credentials,
            metadata=client.metadata,
        )
        return client


def join_stream_thread(thread: threading.Thread | None) -> None:
    """Wait up to :data:`STREAM_STOP_BOUND_S` for a stream's thread to end (not from itself).

    Why a close waits: a gRPC stream that is still being read when the interpreter exits can hang
    the exit for good. Its reader re-takes the call's lock every 0.1 s; a daemon thread stopped at
    exit while it holds that lock leaves it held, and the call's ``__del__`` (run by the main
    thread's final collection) then waits for it forever. A torchrun agent hung so after its
    workers had finished (stack: ``_Rendezvous.__del__`` in ``Condition.__enter__``).
    """
    if thread is not None and thread is not threading.current_thread():
        thread.join(STREAM_STOP_BOUND_S)


_OPEN: weakref.WeakSet[EtcdConnection] = weakref.WeakSet()
"""Connections not closed yet: :func:`_close_at_exit` closes them before the interpreter stops
its daemon threads (see :func:`join_stream_thread`)."""


@atexit.register
def _close_at_exit() -> None:
    for connection in list(_OPEN):
        try:
            connection.close()
        except Exception as exc:  # exiting anyway: one line, never a traceback
            log.debug("closing an etcd connection at exit failed: %s", exc)
    _quiet_grpc_call_finalizers()


def _quiet_grpc_call_finalizers() -> None:
    """From here to the end of the process, a gRPC call object's ``__del__`` does nothing.

    That ``__del__`` takes the call's lock to cancel a call still running. After the exit hooks
    the interpreter stops daemon threads wherever they stand, one of gRPC's may hold that lock,
    and the final collection then waits for it for ever: a plain torchrun agent hung so in CI
    even after every stream of ours had been closed and its thread joined (the call was not
    found). Cancelling a call is moot in a process that is ending: its sockets close with it.
    """
    rendezvous = getattr(getattr(grpc, "_channel", None), "_Rendezvous", None)
    if rendezvous is not None and "__del__" in vars(rendezvous):
        rendezvous.__del__ = _no_finalizer


def _no_finalizer(self: Any) -> None:
    return None


class _Outages:
    """The etcd outages this process sees, by endpoint list: one line when one begins (the first
    failed request of any connection to those endpoints) and one when it ends (the first request
    answered after it), instead of a line per retry."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}
        self._lock = threading.Lock()

    def failed(self, endpoints: str, why: str, budget: float) -> None:
        """A request to ``endpoints`` failed (``why``): the line if this begins an outage."""
        with self._lock:
            if endpoints in self._since:
                return
            self._since[endpoints] = time.monotonic()
        log.warning(
            "etcd at %s does not answer (%s); retrying, each request for up to %gs (one line "
            "when it answers again)", endpoints, why, budget,
        )  # fmt: skip

    def answered(self, endpoints: str) -> None:
        """A request to ``endpoints`` was answered: the line if that ends an outage."""
        with self._lock:
            since = self._since.pop(endpoints, None)
        if since is not None:
            log.warning(
                "etcd at %s answers again (after %.1fs)", endpoints, time.monotonic() - since
            )


_OUTAGES = _Outages()


@contextlib.contextmanager
def quiet_retries() -> Iterator[None]:
    """Silence the per-retry warnings (e.g. a CLI whose failure is reported as one line)."""
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


_WATCHER_CLASSES: dict[int, type] = {}


def _watcher_class(etcd3: Any) -> type:
    """etcd3's ``Watcher`` with two fixes, made once per etcd3 module.

    etcd3 0.12's watch thread re-opens its stream in a tight loop while etcd is unreachable
    (burning a core during an outage), and dies with an unhandled ``ValueError`` once its channel
    is closed (after a failover). This subclass backs off between attempts and ends quietly.
    """
    cached = _WATCHER_CLASSES.get(id(etcd3))
    if cached is not None:
        return cached

    class BackoffWatcher(etcd3.watch.Watcher):  # type: ignore[name-defined,misc]
        _request_queue: queue.Queue[Any]
        _callbacks: dict[Any, Any]

        def _run(self) -> None:
            backoff = 0.05
            while True:
                try:
                    responses = self._watch_stub.Watch(
                        etcd3.watch._new_request_iter(self._request_queue),
                        credentials=self._credentials,
                        metadata=self._metadata,
                    )
                    for response in responses:
                        backoff = 0.05
                        self._handle_response(response)
                except ValueError:  # "Channel closed": this client was closed; stop
                    return
                except grpc.RpcError as err:
                    with self._lock:
                        if self._new_watch:
                            self._new_watch.err = err
                            self._new_watch_cond.notify_all()
                        callbacks, self._callbacks = self._callbacks, {}
                        self._request_queue.put(None)
                        self._request_queue = queue.Queue(maxsize=10)
                    for callback in callbacks.values():
                        etcd3.watch._safe_callback(callback, err)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)

    _WATCHER_CLASSES[id(etcd3)] = BackoffWatcher
    return BackoffWatcher
