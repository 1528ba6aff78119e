"""Job progress in etcd, for ``elastic-trainer status``: published by the launcher of global rank 0.

    publisher = ProgressPublisher.from_settings(settings, metrics)  # the run's RendezvousSettings
    publisher.start()                                           # a daemon thread
    publisher.publish_error("worker rank 1 exited with signal 9 (SIGKILL)")  # one line, rarely
    publisher.close()

``status`` reads them back with :func:`read_progress` from ``{prefix}/{run}/progress/state`` (a
:class:`ProgressRecord` on a lease of three intervals) and ``.../progress/error`` (an
:class:`ErrorRecord` on a lease of the run's ``ttl``). Design: ``docs/design/launcher.md``.

Every node reads its own registry every :data:`POLL_S` (a local read of the workers' files). The
node hosting global rank 0 writes a record at a read where the job moved (its step, world size,
restarts, heals, target or newest checkpoint differ from the last record), else once an
``interval_s`` (default :data:`DEFAULT_INTERVAL_S`). So while training a record is at most
``POLL_S`` old and its step at most the workers' flush interval (1 s) older: under 2 s. etcd load,
whatever the job's size: from rank 0's node at most 1/``POLL_S`` puts a second while training (about
one: the step it reads moves when a worker flushes, once a second) and one lease renewal an
``interval_s``; while nothing moves one put and one renewal an ``interval_s``; from the other nodes
none. No etcd call ever blocks or stops the launcher.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from elastic_trainer.metrics.progress import (
    FAMILIES,
    RateWindow,
    Snapshot,
    progress_view,
    samples_of,
)
from rendezvous.etcd_client import EtcdConnection
from rendezvous.settings import parse_settings

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_trainer.launch.node_metrics import LauncherMetrics
    from rendezvous.settings import RendezvousSettings

log = logging.getLogger(__name__)

THREAD_NAME = "progress-publisher"
DEFAULT_INTERVAL_S = 10.0
"""Seconds between records while the job does not move, and between lease renewals."""
POLL_S = 0.5
"""Seconds between reads of the registry (a record is written at one where the job moved)."""
DEFAULT_ERROR_TTL_S = 7200
MAX_ERROR_CHARS = 300


class ProgressKeys:
    """The etcd keys of one run's progress (``{key_prefix}/{run_id}/progress/``)."""

    def __init__(self, key_prefix: str, run_id: str) -> None:
        if not run_id:
            raise ValueError("run_id must not be empty")
        self.prefix = f"{key_prefix.rstrip('/')}/{run_id}/progress/"
        self.state = self.prefix + "state"
        self.error = self.prefix + "error"

    @classmethod
    def from_settings(cls, settings: RendezvousSettings) -> ProgressKeys:
        """The keys of the settings' run under their ``key_prefix`` (the rendezvous's)."""
        return cls(settings.key_prefix, settings.run_id)

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> ProgressKeys:
        """The keys of ``params.run_id`` under its ``key_prefix``.

        Raises:
            ValueError: a malformed parameter (``RendezvousConfigError``)."""
        return cls.from_settings(parse_settings(params))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _integer(value: Any) -> int | None:
    number = _number(value)
    return None if number is None or number != int(number) else int(number)


@dataclass(kw_only=True, slots=True)
class ProgressRecord:
    """The job's progress as the node of global rank 0 last published it."""

    node: str
    """The publishing node's name (:mod:`elastic_trainer.metrics.node_name`)."""
    published_unix: float
    step: int | None = None
    total_steps: int | None = None
    world_size: int | None = None
    steps_per_s: float | None = None
    samples_per_s: float | None = None
    """The job's throughput, scaled from the publishing node's ranks (see :mod:`elastic_trainer.metrics.progress`)."""
    step_time_p50_s: float | None = None
    loss: float | None = None
    lr: float | None = None
    last_step_unix: float | None = None
    last_checkpoint_step: int | None = None
    last_checkpoint_unix: float | None = None
    restarts: int | None = None
    """The job's restarts (:func:`~elastic_trainer.metrics.progress.job_counts`: this node's
    ``elastic_trainer_restarts_total``, rank 0's node)."""
    heals: int | None = None
    """The job's in-place heals, counted the same way (``elastic_trainer_heals_total``)."""

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> ProgressRecord | None:
        """The record, or ``None`` if ``raw`` is missing or not one (bad fields read as unknown)."""
        data = _json_object(raw)
        if data is None or not isinstance(data.get("node"), str):
            return None
        published = _number(data.get("published_unix"))
        if published is None:
            return None
        values: dict[str, Any] = {"node": data["node"], "published_unix": published}
        for f in fields(cls):
            if f.name not in values:
                values[f.name] = (_integer if f.name in _INTEGER_FIELDS else _number)(
                    data.get(f.name)
                )
        return cls(**values)


_INTEGER_FIELDS = frozenset(
    {"step", "total_steps", "world_size", "last_checkpoint_step", "restarts", "heals"}
)


@dataclass(kw_only=True, slots=True)
class ErrorRecord:
    """The last error a launcher reported for the run: one line."""

    node: str
    text: str
    unix: float

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> ErrorRecord | None:
        data = _json_object(raw)
        if data is None:
            return None
        node, text, unix = data.get("node"), data.get("text"), _number(data.get("unix"))
        if not isinstance(node, str) or not isinstance(text, str) or unix is None:
            return None
        return cls(node=node, text=text, unix=unix)


def _json_object(raw: bytes | None) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # also bad UTF-8
        return None
    return data if isinstance(data, dict) else None


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """The first non-empty line of ``text``, at most ``limit`` characters."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


class _Collectable(Protocol):
    def collect(self) -> Iterable[Any]: ...


class _NotFromThePublisher(logging.Filter):
    """Drops the etcd client's per-retry warnings raised on the publisher's thread: the
    publisher reports an outage once itself (the rendezvous's own retries still show)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != THREAD_NAME


class ProgressPublisher:
    """Publishes this node's view of the job to etcd while it hosts global rank 0 (see the
    module docstring).

    Args:
        connection: etcd; the publisher uses it from its own thread (and closes it on
            :meth:`close` when ``owns_connection``).
        keys: where to write.
        registry: the launcher's metrics registry (``LauncherMetrics.registry``).
        node: this node's name.
        interval_s: seconds between records while the job does not move (and between lease
            renewals); the registry is read every :data:`POLL_S` (or ``interval_s`` if shorter).
        error_ttl_s: seconds an error record lives.
        owns_connection: close ``connection`` in :meth:`close`.
        clock: monotonic time (injectable for tests); wall_clock: unix time for the records.

    Raises:
        ValueError: a non-positive interval or TTL.
    """

    def __init__(
        self,
        connection: EtcdConnection,
        keys: ProgressKeys,
        registry: _Collectable,
        *,
        node: str,
        interval_s: float = DEFAULT_INTERVAL_S,
        error_ttl_s: int = DEFAULT_ERROR_TTL_S,
        owns_connection: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if error_ttl_s < 1:
            raise ValueError(f"error_ttl_s must be >= 1, got {error_ttl_s}")
        self._connection = connection
        self.keys = keys
        self._registry = registry
        self.node = node
        self.interval_s = interval_s
        self.poll_s = min(POLL_S, interval_s)
        self._ttl = max(2, math.ceil(3 * interval_s))
        self._error_ttl = error_ttl_s
        self._owns_connection = owns_connection
        self._clock = clock
        self._wall_clock = wall_clock
        self._window = RateWindow(span_s=max(60.0, 3 * interval_s))
        self._lease_id: int | None = None
        self._renewed_at = -math.inf  # monotonic time the lease was last granted or renewed
        self._written: tuple[float, ProgressRecord] | None = None  # (monotonic time, record)
        self._lock = threading.Lock()
        self._pending_error: ErrorRecord | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._final_budget = DEFAULT_INTERVAL_S
        self._quiet = _NotFromThePublisher()

    @classmethod
    def from_settings(
        cls,
        settings: RendezvousSettings,
        metrics: LauncherMetrics,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> ProgressPublisher:
        """A publisher for the settings' run (endpoints, TLS, auth, key prefix; ``ttl`` for
        errors) over its own etcd connection, reading ``metrics``' registry (the families
        progress is made of).

        Raises:
            ValueError: no endpoint in ``settings`` (``RendezvousConfigError``)."""
        connection = EtcdConnection(settings.client_config())
        reader = metrics.reader(FAMILIES)  # what progress_view reads, not every histogram
        return cls(connection, ProgressKeys.from_settings(settings), reader, node=metrics.node,
                   interval_s=interval_s, error_ttl_s=settings.ttl, owns_connection=True)  # fmt: skip

    @classmethod
    def from_params(
        cls,
        params: RendezvousParameters,
        metrics: LauncherMetrics,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> ProgressPublisher:
        """:meth:`from_settings` for torchrun's parameters (``--rdzv-endpoint``, ``--rdzv-conf``).

        Raises:
            ValueError: a malformed parameter (``RendezvousConfigError``, naming the key)."""
        return cls.from_settings(parse_settings(params), metrics, interval_s=interval_s)

    # -- launcher side ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start publishing from a daemon thread (idempotent)."""
        if self._thread is None:
            logging.getLogger("rendezvous.etcd_client").addFilter(self._quiet)
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def publish_error(self, text: str) -> None:
        """Report an error of the run (its first line is kept): written at once by the
        publisher's thread, never blocking the caller. The latest error wins."""
        record = ErrorRecord(
            node=self.node, text=one_line(text) or "unknown error", unix=self._wall_clock()
        )
        with self._lock:
            self._pending_error = record
        self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (after it wrote a pending error, within ``timeout_s``); idempotent."""
        self._final_budget = timeout_s
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=timeout_s)
            if thread.is_alive():
                log.warning(
                    "progress publisher: etcd did not answer within %.0fs; stopped anyway",
                    timeout_s,
                )
        elif self._pending_error is not None:
            self._write_error(retry_timeout=timeout_s)  # never started: write it here
        logging.getLogger("rendezvous.etcd_client").removeFilter(self._quiet)
        if self._owns_connection:
            self._connection.close()

    # -- one round (the thread calls these; tests may too) --------------------------------------

    def publish_once(self) -> ProgressRecord | None:
        """Read the registry; if this node hosts global rank 0 and a record is due (the job
        moved since the last one, or ``interval_s`` passed: :func:`record_due`), write it.

        Returns:
            The record written, or ``None`` (not rank 0's node, or nothing due).

        Raises:
            RendezvousConnectionError: etcd did not take the write.
        """
        now = self._clock()
        snapshot = Snapshot.from_samples(samples_of(self._registry.collect()), taken_at=now)
        baseline = self._window.add(snapshot)
        if not any(rank == 0 for _, rank in snapshot.live_ranks):
            return None
        view = progress_view(snapshot, baseline)
        restarts, heals = view.restarts, view.heals  # the job's, as `top` counts them
        record = ProgressRecord(
            node=self.node, published_unix=self._wall_clock(), step=view.step, total_steps=view.total_steps,
            world_size=view.world_size, steps_per_s=view.steps_per_s, samples_per_s=view.samples_per_s,
            step_time_p50_s=view.step_time_p50_s, loss=view.loss, lr=view.lr, last_step_unix=view.last_step_unix,
            last_checkpoint_step=view.last_checkpoint_step, last_checkpoint_unix=view.last_checkpoint_unix,
            restarts=None if restarts is None else int(restarts), heals=None if heals is None else int(heals),
        )  # fmt: skip
        if not record_due(record, self._written, now=now, interval_s=self.interval_s):
            return None
        self._put_progress(record.encode(), now=now)
        self._written = (now, record)
        return record

    def _put_progress(self, value: bytes, *, now: float) -> None:
        budget = min(self.interval_s, self._connection.config.retry_timeout)
        lease_id = self._lease_id
        if lease_id is not None and now - self._renewed_at >= self.interval_s:
            try:
                alive = self._connection.call(lambda c: int(list(c.refresh_lease(lease_id))[0].TTL) > 0,
                                              what="a progress lease renewal", retry_timeout=budget)  # fmt: skip
            except Exception:
                alive = False  # lease gone (etcd restored, expired while cut off): grant a new one
            if not alive:
                lease_id = None
            else:
                self._renewed_at = now
        if lease_id is None:
            lease = self._connection.call(lambda c: c.lease(self._ttl), what="a progress lease grant",
                                          retry_timeout=budget)  # fmt: skip
            lease_id = self._lease_id = int(lease.id)
            self._renewed_at = now
        try:
            self._connection.call(lambda c: c.put(self.keys.state, value, lease=lease_id),
                                  what="a progress write", retry_timeout=budget)  # fmt: skip
        except Exception:
            self._renewed_at = -math.inf  # the lease may be gone: check it before the next write
            raise

    def _write_error(self, *, retry_timeout: float) -> None:
        with self._lock:
            record, self._pending_error = self._pending_error, None
        if record is None:
            return
        try:
            lease = self._connection.call(lambda c: c.lease(self._error_ttl), what="an error lease grant",
                                          retry_timeout=retry_timeout)  # fmt: skip
            self._connection.call(lambda c: c.put(self.keys.error, record.encode(), lease=int(lease.id)),
                                  what="an error write", retry_timeout=retry_timeout)  # fmt: skip
        except Exception as exc:
            log.warning("progress publisher: could not record the error in etcd: %s", exc)

    def _run(self) -> None:
        next_at = self._clock()
        while not self._stop.is_set():
            if self._pending_error is not None:
                self._write_error(
                    retry_timeout=min(self.interval_s, self._connection.config.retry_timeout)
                )
            now = self._clock()
            if now >= next_at:
                next_at = now + self.poll_s
                try:
                    self.publish_once()
                except Exception as exc:  # etcd away, a registry read failed: try next poll
                    if not self._failing:
                        log.warning("progress publisher: %s (retrying every %gs)", exc, self.poll_s)
                    self._failing = True
                else:
                    if self._failing:
                        log.warning("progress publisher: publishing again")
                    self._failing = False
            self._wake.wait(max(0.0, next_at - self._clock()))
            self._wake.clear()
        if self._pending_error is not None:  # reported just before close()
            self._write_error(retry_timeout=self._final_budget)


_MOVES = ("step", "world_size", "restarts", "heals", "total_steps", "last_checkpoint_step")
"""The record's fields whose change is worth a write at once (rates and loss follow the step)."""


def record_due(
    record: ProgressRecord,
    written: tuple[float, ProgressRecord] | None,
    *,
    now: float,
    interval_s: float,
) -> bool:
    """Whether ``record`` should be written at monotonic time ``now``, ``written`` being the
    (time, record) of the last write: none yet, ``interval_s`` passed, or the job moved."""
    if written is None or now - written[0] >= interval_s:
        return True
    last = written[1]
    return any(getattr(record, name) != getattr(last, name) for name in _MOVES)


def read_progress(
    connection: EtcdConnection, keys: ProgressKeys
) -> tuple[ProgressRecord | None, ErrorRecord | None]:
    """The run's published progress and last error (one request; either may be ``None``).

    Raises:
        RendezvousConnectionError: etcd cannot be read.
    """
    response = connection.call(
        lambda c: c.get_prefix_response(keys.prefix), what="a progress read", read=True
    )
    progress = error = None
    for kv in response.kvs:
        key = kv.key.decode()
        if key == keys.state:
            progress = ProgressRecord.decode(kv.value)
        elif key == keys.error:
            error = ErrorRecord.decode(kv.value)
    return progress, error
