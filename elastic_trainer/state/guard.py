"""The lock around every change of the training state, and the step boundaries it sees.

Invariant: the state (every saved object, the step count, rank 0's buffers) changes only inside
:meth:`StateGuard.update`; whoever holds :meth:`StateGuard.hold` (a just-in-time save, a heal's
snapshot for peers) sees the state of one completed step, never half of the next.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator


class GuardTimeoutError(Exception):
    """The training thread stayed inside an update longer than a snapshot could wait."""


class StateGuard:
    """The lock held around every change of the training state; a JIT snapshot holds it too.

    Also tracks step boundaries (for stall detection): :meth:`boundary` after every step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.consistent = True
        """False once an exception escaped an update: the state may be half-updated."""
        self.progress = threading.Event()
        """Set at every step boundary (and when a checkpoint write ends)."""
        self._durations: deque[float] = deque(maxlen=8)
        self._last_boundary: float | None = None

    @contextlib.contextmanager
    def update(self) -> Iterator[None]:
        """Main thread, around the update section; an exception marks the state inconsistent."""
        with self._lock:
            try:
                yield
            except BaseException:
                self.consistent = False
                raise

    @contextlib.contextmanager
    def hold(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the guard (no update can start or be in progress).

        Raises:
            GuardTimeoutError: not acquired within ``timeout`` seconds (``None``: wait as long as needed).
        """
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise GuardTimeoutError(
                f"the training thread stayed inside an optimizer update for {timeout:.1f} s"
            )
        try:
            yield
        finally:
            self._lock.release()

    def boundary(self) -> None:
        """A step ended (main thread)."""
        now = time.monotonic()
        if self._last_boundary is not None:
            self._durations.append(now - self._last_boundary)
        self._last_boundary = now
        self.progress.set()

    @property
    def recent_step_s(self) -> float:
        """The longest of the last few step durations (0 before two boundaries)."""
        return max(self._durations, default=0.0)
