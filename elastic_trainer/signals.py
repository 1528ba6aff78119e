"""Graceful stop on SIGTERM/SIGINT: finish the step, checkpoint, exit within a grace period.

torchrun's agent forwards SIGTERM to its workers when the node is preempted or scaled down, and
when it restarts the group for a new member, and SIGKILLs them 30 s later. The handler only sets
a flag; the training loop checks it at the end of every step (all ranks agree on it through one
collective, so they stop after the same step and rank 0 checkpoints that step). A watchdog ends
the process at the deadline should the stop itself hang (e.g. a peer vanished mid-collective).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """Installs handlers for ``signals``; :attr:`requested` turns true on the first one.

    Args:
        grace_s: seconds from the signal until the process is ended regardless.
        signals: the signals to handle.
    """

    def __init__(self, grace_s: float, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.grace_s = grace_s
        self.signals = signals
        self.signum: int | None = None
        self.deadline: float | None = None
        self._previous: dict[int, Any] = {}
        self._finished = threading.Event()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline, ``None`` when no stop was requested."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def install(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread: SIGTERM will not trigger a checkpoint")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers and disarm the watchdog."""
        self._finished.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            log.warning("received %s again; still stopping", signal.Signals(signum).name)
            return
        self.signum = signum
        self.deadline = time.monotonic() + self.grace_s
        log.warning(
            "received %s: finishing the current step, checkpointing, exiting within %.0f s",
            signal.Signals(signum).name, self.grace_s,
        )
        threading.Thread(target=self._watchdog, name="sigterm-grace", daemon=True).start()

    def _watchdog(self) -> None:
        if self._finished.wait(self.grace_s):
            return
        log.error("graceful stop did not finish within %.0f s; exiting now", self.grace_s)
        logging.shutdown()
        os._exit(128 + (self.signum or signal.SIGTERM))
