"""Graceful stop on SIGTERM/SIGINT: finish the step, checkpoint, exit within a grace period.

:class:`GracefulStop`'s handler only sets a flag (the loop reads it at the end of every step and
all ranks agree through one collective); a watchdog ends the process at the deadline should the
stop itself hang. :class:`SignalWakeup` reports the signal at once on another thread, through
``signal.set_wakeup_fd``, even while the main thread is blocked in a C++ collective
(:mod:`elastic_trainer.checkpoint.jit` uses it): on the worker's heartbeat thread when one beats
(under ``elastic-trainer run``; one thread fewer), else on a thread of its own. Design:
``docs/design/graceful-stop.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from elastic_trainer.runtime import heartbeat
from elastic_trainer.runtime.settings import ENV_HEAL_MARKER, ENV_STOPPING_FILE

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def lone_signal(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a stop signal this process got is a kill of this one process, not its launcher
    stopping the node: the launcher marks :data:`ENV_STOPPING_FILE`'s file while it stops its
    workers, and only a process that heals in place (its heal marker exists) asks. Such a process
    ends like a crash, and a replacement joins its peers in place: a worker's process tree is one
    unit, whatever signal hits it (``docs/design/heal-in-place.md``)."""
    env = os.environ if environ is None else environ
    stopping, marker = env.get(ENV_STOPPING_FILE), env.get(ENV_HEAL_MARKER)
    return (
        bool(stopping and marker)
        and os.path.exists(marker or "")
        and not os.path.exists(stopping or "")
    )


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
        if lone_signal():
            log.warning(
                "received %s, not from this worker's launcher: ending this process as if killed, so "
                "that a replacement joins its peers in place",
                signal.Signals(signum).name,
            )
            logging.shutdown()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is not None:
            log.warning("received %s again; still stopping", signal.Signals(signum).name)
            return
        self.signum = signum
        self.deadline = time.monotonic() + self.grace_s
        log.warning(
            "received %s: finishing the current step, checkpointing, exiting within %.0f s",
            signal.Signals(signum).name,
            self.grace_s,
        )
        threading.Thread(target=self._watchdog, name="sigterm-grace", daemon=True).start()

    def _watchdog(self) -> None:
        if self._finished.wait(self.grace_s):
            return
        log.error("graceful stop did not finish within %.0f s; exiting now", self.grace_s)
        logging.shutdown()
        os._exit(128 + (self.signum or signal.SIGTERM))


class SignalWakeup:
    """Calls ``callback(signum)`` on another thread as soon as one of ``signals`` arrives: the
    heartbeat's thread when this process beats (:meth:`~elastic_trainer.runtime.heartbeat.Heartbeat.watch`),
    else a thread of its own.

    Works while the main thread is blocked in C code (see the module docstring). Python handlers
    must already be installed for ``signals`` (:class:`GracefulStop` installs them): CPython
    writes to the wakeup descriptor only for signals that have a Python handler. Other signals
    with Python handlers (e.g. the DataLoader's SIGCHLD) are ignored here, and any wakeup
    descriptor installed before (asyncio's) keeps receiving every byte.

    Args:
        callback: runs on the reader thread; must not block for long.
        signals: the signals to report.
    """

    _fork_hook_registered = False
    _active: SignalWakeup | None = None

    def __init__(
        self, callback: Callable[[int], None], signals: tuple[signal.Signals, ...] = STOP_SIGNALS
    ) -> None:
        self._callback = callback
        self._signals = {int(s) for s in signals}
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._previous_fd = -1
        self._thread: threading.Thread | None = None
        self._host: heartbeat.Heartbeat | None = None
        self._closing = False

    @property
    def installed(self) -> bool:
        return self._thread is not None or self._host is not None

    def install(self) -> SignalWakeup:
        """Route signal bytes to the reader thread (main thread only; elsewhere a warning)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "not on the main thread: a signal during a blocked collective will not be noticed early"
            )
            return self
        read_fd, write_fd = os.pipe()
        os.set_blocking(
            write_fd, False
        )  # required by set_wakeup_fd: a full pipe must not block a handler
        self._read_fd, self._write_fd = read_fd, write_fd
        self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if self._previous_fd != -1:
            log.info(
                "chaining the wakeup descriptor %d that was installed before", self._previous_fd
            )
        SignalWakeup._active = self
        if not SignalWakeup._fork_hook_registered:
            # A forked child (DataLoader worker) inherits the descriptor: its own signals would
            # look like ours. The child forgets it.
            os.register_at_fork(after_in_child=SignalWakeup._forget_in_child)
            SignalWakeup._fork_hook_registered = True
        beating = heartbeat.current()
        if beating is not None and beating.watch(read_fd, self._drain):
            self._host = beating
            return self
        self._thread = threading.Thread(target=self._read, name="signal-wakeup", daemon=True)
        self._thread.start()
        return self

    def uninstall(self) -> None:
        """Restore the previous wakeup descriptor and stop reading it."""
        if not self.installed or self._write_fd is None or self._read_fd is None:
            return
        current = signal.set_wakeup_fd(self._previous_fd)
        if current != self._write_fd:
            log.warning(
                "the signal wakeup descriptor was replaced by someone else (%d); restored anyway",
                current,
            )
        SignalWakeup._active = None
        self._closing = True
        if self._host is not None:
            self._host.unwatch(self._read_fd)  # on return the heartbeat's thread no longer reads it
            self._host = None
        elif self._thread is not None:
            with contextlib.suppress(OSError):
                os.write(self._write_fd, b"\0")  # wakes the reader, which then exits
            self._thread.join(5)
        os.close(self._write_fd)
        os.close(self._read_fd)
        self._thread = None
        self._read_fd = self._write_fd = None

    @staticmethod
    def _forget_in_child() -> None:
        if SignalWakeup._active is not None:
            SignalWakeup._active = None
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(-1)

    def _read(self) -> None:
        if self._read_fd is None:
            raise RuntimeError("signal pipe read before it was installed")
        while True:
            try:
                data = os.read(self._read_fd, 512)
            except OSError:
                return
            if self._closing or not data:
                return
            self._deliver(data)

    def _drain(self, fd: int) -> None:
        """(The heartbeat's thread) the pipe is readable: one read, which does not block."""
        try:
            data = os.read(fd, 512)
        except OSError:
            return
        if data and not self._closing:
            self._deliver(data)

    def _deliver(self, data: bytes) -> None:
        """Pass ``data`` on to a wakeup descriptor installed before, and report our signals."""
        if self._previous_fd != -1:
            with contextlib.suppress(OSError):
                os.write(self._previous_fd, data)
        for signum in data:
            if signum in self._signals:
                try:
                    self._callback(signum)
                except Exception:  # noqa: BLE001 - a failing callback must not kill the reader silently
                    log.exception(
                        "signal wakeup callback failed for %s", signal.Signals(signum).name
                    )
