"""One background thread per etcd connection that runs short timed tasks, in due order.

The lease rendezvous needs a few things done later and off the caller's thread: claim the
coordinator role after a random delay, register again after a lease expired. A thread per task
would mean a thread per simulated node in a benchmark of ten thousand; one scheduler per
connection serves every handler on it (in production, one handler per process). Tasks must be
short and bounded (a single etcd request with a short retry budget); an exception is logged and
never stops the thread.

    scheduler = Scheduler.of(connection)
    scheduler.call_later(0.5, lambda: print("half a second later"))
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable

from rendezvous.etcd_client import EtcdConnection

log = logging.getLogger(__name__)

_SHARED: weakref.WeakKeyDictionary[EtcdConnection, Scheduler] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


class Scheduler:
    """Runs ``fn()`` at ``time.monotonic() + delay`` on one daemon thread."""

    def __init__(self, name: str = "etcd-v3-tasks") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    @classmethod
    def of(cls, connection: EtcdConnection) -> Scheduler:
        """The scheduler shared by everything on ``connection`` (stopped when it closes)."""
        with _SHARED_LOCK:
            scheduler = _SHARED.get(connection)
            if scheduler is None:
                scheduler = _SHARED[connection] = cls()
                connection.add_close_hook(scheduler.close)
            return scheduler

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` in ``delay`` seconds (at once if ``delay <= 0``); ignored once closed."""
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (time.monotonic() + max(delay, 0.0), next(self._seq), fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        """Drop pending tasks and stop the thread (a running task finishes)."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(timeout)
                if self._closed:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:
                log.exception("etcd-v3: a background task failed")
