"""A worker's heartbeat: a small slot file its launcher reads to tell a frozen worker from a slow one.

    mkdir -p /tmp/hb && ELASTIC_TRAINER_HEARTBEAT_DIR=/tmp/hb python -c \\
        "from elastic_trainer.runtime import heartbeat; heartbeat.start_from_environ(); heartbeat.note_step(1)"

Under ``elastic-trainer run`` the launcher names a per-node directory in
``ELASTIC_TRAINER_HEARTBEAT_DIR``; :func:`start_from_environ` (called by the worker entry point
before the target runs) creates this process's slot there and starts a daemon thread that bumps a
beat counter every :data:`BEAT_INTERVAL_S`. :func:`note_step` records the last completed step.
Without the variable both are no-ops. The launcher's watchdog
(:mod:`elastic_trainer.launch.watchdog`) stops a worker whose beat stalls. Design:
``docs/design/launcher.md`` ("Frozen workers").

The beat thread waits in ``select`` and may serve other descriptors between beats
(:meth:`Heartbeat.watch`): the graceful stop's signal wakeup reads its pipe there instead of on
a thread of its own (``runtime/signals.py``; one worker thread fewer, issue 30). What it runs
for them must read without blocking and return at once: a late beat looks like a freeze.

Invariants:

* a stopped process (SIGSTOP) stops every thread, and a process deadlocked holding the GIL starves
  the beat thread: both stop beating. A process blocked in a C call that releases the GIL (a
  collective waiting for a frozen peer, a sleep) keeps beating: it waits, it is not frozen;
* the slot is a fixed binary layout (:data:`HEADER`, then the beat and step blocks) in native byte
  order (it never leaves the node); it appears complete (written aside, then renamed) and is
  removed when the process exits normally; the launcher removes the slots of dead processes;
* the step block is a sequence lock: the writer stores the trailing copy of the step, then its
  time, then the leading copy; a reader that copies the block front to back and finds both copies
  equal has a consistent pair (:func:`read_slot`);
* stdlib only, no torch: it runs before the target imports anything;
* a forked child (a DataLoader worker) never writes into its parent's slot.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import select
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastic_trainer.runtime.settings import ENV_HEARTBEAT_DIR

BEAT_INTERVAL_S = 0.5
"""Seconds between beats."""

MAGIC = b"ETHB"
VERSION = 1
SLOT_SUFFIX = ".slot"
HEADER = struct.Struct("@4sHHiiiiQ")
"""magic, version, reserved, pid, global rank, local rank, reserved, process start time (clock
ticks since boot, ``/proc/PID/stat`` field 22: tells a reused pid apart)."""
_BEAT = struct.Struct("@Qq")
"""Beat counter, ``time.monotonic_ns()`` of the last beat."""
_STEP = struct.Struct("@qqq")
"""Leading copy of the last completed step, its ``time.monotonic_ns()``, trailing copy."""
_INT64 = struct.Struct("@q")
_BEAT_OFFSET = HEADER.size
_STEP_OFFSET = _BEAT_OFFSET + _BEAT.size
SLOT_SIZE = _STEP_OFFSET + _STEP.size
NO_STEP = -1
"""The step fields before the first :func:`note_step`."""

_current: Heartbeat | None = None
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class SlotReading:
    """One read of a slot."""

    pid: int
    rank: int
    """Global rank (-1: not started by torchrun)."""
    local_rank: int
    start_ticks: int
    """Start time of the process (0 where ``/proc`` is missing)."""
    beats: int
    beat_ns: int
    """The worker's ``time.monotonic_ns()`` at the last beat."""
    step: int | None
    """Last completed step; ``None`` before the first or when the read raced a write."""
    step_ns: int
    """The worker's ``time.monotonic_ns()`` when ``step`` completed."""


def process_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot; ``None`` when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[-1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def slot_path(directory: Path, pid: int) -> Path:
    return directory / f"worker-{pid}{SLOT_SUFFIX}"


def read_slot(path: Path) -> SlotReading | None:
    """Read a slot file; ``None`` if it is gone, incomplete or not a slot of this version."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < SLOT_SIZE:
        return None
    magic, version, _, pid, rank, local_rank, _, start_ticks = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        return None
    beats, beat_ns = _BEAT.unpack_from(data, _BEAT_OFFSET)
    leading, step_ns, trailing = _STEP.unpack_from(data, _STEP_OFFSET)
    step = leading if leading == trailing and leading != NO_STEP else None
    return SlotReading(
        pid=pid,
        rank=rank,
        local_rank=local_rank,
        start_ticks=start_ticks,
        beats=beats,
        beat_ns=beat_ns,
        step=step,
        step_ns=step_ns if step is not None else 0,
    )


class Heartbeat:
    """This process's slot and its beat thread (see the module docstring).

    Args:
        directory: the per-node slot directory (must exist).
        rank: global rank, shown by the launcher when it stops this worker.
        local_rank: rank on this node.
        interval_s: seconds between beats.

    Raises:
        OSError: the slot cannot be created.
    """

    def __init__(
        self, directory: Path, *, rank: int, local_rank: int, interval_s: float = BEAT_INTERVAL_S
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s}")
        self.pid = os.getpid()
        self.path = slot_path(directory, self.pid)
        self.interval_s = interval_s
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch_lock = threading.Condition()
        self._watched: dict[int, Callable[[int], None]] = {}
        """Descriptors the beat thread also waits for, and what it calls when one is readable."""
        self._rounds = 0
        """Waits the beat thread finished (guarded by ``_watch_lock``; :meth:`unwatch` waits on it)."""
        image = bytearray(SLOT_SIZE)
        HEADER.pack_into(
            image,
            0,
            MAGIC,
            VERSION,
            0,
            self.pid,
            rank,
            local_rank,
            0,
            process_start_ticks(self.pid) or 0,
        )
        _BEAT.pack_into(image, _BEAT_OFFSET, 0, time.monotonic_ns())
        _STEP.pack_into(image, _STEP_OFFSET, NO_STEP, 0, NO_STEP)
        staging = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, bytes(image))
            self._map = mmap.mmap(fd, SLOT_SIZE)
            os.replace(staging, self.path)  # readers never see a partly written slot
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise
        finally:
            os.close(fd)
        self._wake_read, self._wake_write = os.pipe()  # wakes the beat thread's select
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    def beat(self) -> None:
        """One beat (the thread calls it every ``interval_s``)."""
        self._beats += 1
        _BEAT.pack_into(self._map, _BEAT_OFFSET, self._beats, time.monotonic_ns())

    def note_step(self, step: int) -> None:
        """Record that ``step`` completed now (writes three integers into the mapped slot)."""
        store = _INT64.pack_into
        store(self._map, _STEP_OFFSET + 16, step)  # trailing copy first ...
        store(self._map, _STEP_OFFSET + 8, time.monotonic_ns())
        store(self._map, _STEP_OFFSET, step)  # ... leading copy last (see the module docstring)

    def start(self) -> None:
        """Start the beat thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="elastic-trainer-heartbeat", daemon=True
            )
            self._thread.start()

    def watch(self, fd: int, on_readable: Callable[[int], None]) -> bool:
        """Also wait for ``fd`` on the beat thread and call ``on_readable(fd)`` there whenever it
        is readable (it must read without blocking and return at once). Returns ``False`` when
        no beat thread runs: the caller then waits for ``fd`` itself."""
        with self._watch_lock:
            thread = self._thread
            if thread is None or not thread.is_alive() or self._stop.is_set():
                return False
            self._watched[fd] = on_readable
        self._wake()
        return True

    def unwatch(self, fd: int) -> None:
        """Stop waiting for ``fd``. On return the beat thread no longer uses it: it may be closed."""
        with self._watch_lock:
            if self._watched.pop(fd, None) is None:
                return
            thread, rounds = self._thread, self._rounds
        if thread is None or thread is threading.current_thread():
            return
        self._wake()
        deadline = time.monotonic() + 2 * self.interval_s + 1.0
        with self._watch_lock:
            # A wait that began before the removal ends, and the next one leaves fd out.
            while self._rounds <= rounds and thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._watch_lock.wait(left)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake is pending anyway; closed: stopping
            os.write(self._wake_write, b"\0")

    def _run(self) -> None:
        next_beat = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            with self._watch_lock:
                watched = list(self._watched)
            try:
                ready, _, _ = select.select(
                    [self._wake_read, *watched], [], [], max(0.0, next_beat - time.monotonic())
                )
            except OSError:  # a descriptor closed without unwatch: drop the ones that are gone
                ready = []
                with self._watch_lock:
                    for fd in watched:
                        try:
                            os.fstat(fd)
                        except OSError:
                            self._watched.pop(fd, None)
            if self._stop.is_set():
                break
            for fd in ready:
                if fd == self._wake_read:
                    with contextlib.suppress(OSError):
                        os.read(fd, 512)
                    continue
                with self._watch_lock:
                    on_readable = self._watched.get(fd)
                if on_readable is not None:
                    try:
                        on_readable(fd)
                    except Exception as exc:  # noqa: BLE001 - the beats must go on
                        with self._watch_lock:
                            self._watched.pop(fd, None)
                        print(f"elastic-trainer: the heartbeat stops reading descriptor {fd}: {exc!r}",
                              file=sys.stderr, flush=True)  # fmt: skip
            now = time.monotonic()
            if now >= next_beat:
                self.beat()
                next_beat = now + self.interval_s
            with self._watch_lock:
                self._rounds += 1
                self._watch_lock.notify_all()

    def close(self) -> None:
        """Stop beating and remove the slot. Idempotent."""
        self._stop.set()
        self._wake()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * self.interval_s + 1.0)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if thread is None or not thread.is_alive():
            with contextlib.suppress(BufferError, ValueError):
                self._map.close()
            for end in (self._wake_read, self._wake_write):
                with contextlib.suppress(OSError):
                    os.close(end)
            self._wake_read = self._wake_write = -1


def start_from_environ(environ: dict[str, str] | None = None) -> Heartbeat | None:
    """Start this process's heartbeat when ``ELASTIC_TRAINER_HEARTBEAT_DIR`` is set; idempotent.

    A slot that cannot be created is reported in one line on stderr and the worker runs on
    unwatched (the watchdog then never stops it): the heartbeat must not end a training run.

    Returns:
        The running heartbeat, or ``None`` when there is none.
    """
    global _current
    env = os.environ if environ is None else environ
    directory = env.get(ENV_HEARTBEAT_DIR, "").strip()
    with _lock:
        if _current is not None or not directory:
            return _current
        try:
            heartbeat = Heartbeat(
                Path(directory),
                rank=_int(env.get("RANK"), -1),
                local_rank=_int(env.get("LOCAL_RANK"), -1),
            )
        except (OSError, ValueError) as exc:
            print(
                f"elastic-trainer: no heartbeat for this worker ({ENV_HEARTBEAT_DIR}={directory}: "
                f"{getattr(exc, 'strerror', None) or exc}); the frozen-worker watchdog cannot see it",
                file=sys.stderr,
                flush=True,
            )
            return None
        heartbeat.start()
        atexit.register(stop)
        _current = heartbeat
        return heartbeat


def note_step(step: int) -> None:
    """Record that ``step`` completed now; a no-op without a heartbeat. Call it after every step."""
    heartbeat = _current
    if heartbeat is not None:
        heartbeat.note_step(step)


def current() -> Heartbeat | None:
    """This process's heartbeat, if started."""
    return _current


def stop() -> None:
    """Stop this process's heartbeat and remove its slot (at exit; idempotent)."""
    global _current
    with _lock:
        heartbeat, _current = _current, None
    if heartbeat is not None:
        heartbeat.close()


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _forget_in_child() -> None:
    # The child shares the parent's mapping but not its beat thread: it must not write or unlink.
    global _current, _lock
    _current = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
