"""The frozen-worker watchdog: a launcher thread that stops a worker whose heartbeat stalls.

    watchdog = FrozenWorkerWatchdog(WatchdogConfig(directory=heartbeat_dir, node="host-4242"))
    watchdog.start()      # workers started with ELASTIC_TRAINER_HEARTBEAT_DIR=heartbeat_dir
    ...
    watchdog.stop()

A worker that is alive but makes no progress (SIGSTOP, a deadlock holding the GIL) blocks its
peers in their collectives until the 30-minute collective timeout, and torchrun's agent sees a
healthy process. Every worker beats into a slot file (:mod:`elastic_trainer.runtime.heartbeat`);
every :data:`POLL_INTERVAL_S` this thread reads the node's slots, and a worker whose beat counter
has not changed for longer than the threshold -- ``max(floor, 5 x the median step time)`` -- is
named in one warning line, counted, and SIGKILLed. From there the job heals as after any worker
SIGKILL. Design: ``docs/design/launcher.md`` ("Frozen workers").

Invariants:

* silence is measured on this process's monotonic clock, from the polls that saw the counter
  unchanged; a gap between two polls counts :data:`MAX_GAP_S` at most, so a launcher that was
  itself paused or starved never blames a worker for the time it could not watch;
* a worker blocked in a collective behind a frozen peer, or merely slow, keeps beating and is
  never stopped;
* a slot whose process is gone (or whose pid now names another process: the slot records the
  start time) is removed, never acted on; each frozen worker is stopped and counted once;
* :class:`StallTracker` decides, without I/O (unit-tested with a fake clock); the watchdog reads
  the slots and acts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from elastic_trainer.runtime.heartbeat import SLOT_SUFFIX, SlotReading, read_slot

log = logging.getLogger(__name__)

DEFAULT_FLOOR_S = 10.0
"""The least silence that makes a worker frozen (``--frozen-timeout``)."""
STEP_FACTOR = 5.0
"""The threshold is at least this many median step times."""
POLL_INTERVAL_S = 0.5
"""Seconds between two reads of the slots."""
MAX_GAP_S = 2.0
"""The most silence one gap between polls can add (see the module docstring)."""
STEP_WINDOW = 64
"""Recent step durations the median is taken over."""


@dataclass(kw_only=True, slots=True)
class WatchdogConfig:
    """Where the slots are and when a worker counts as frozen."""

    directory: Path
    """The node's heartbeat directory (the workers' ``ELASTIC_TRAINER_HEARTBEAT_DIR``)."""
    node: str
    """This node's name, for the log line (the ``node`` metric label)."""
    floor_s: float = DEFAULT_FLOOR_S
    """Least silence, in seconds, that makes a worker frozen."""
    step_factor: float = STEP_FACTOR
    """The threshold is at least this many median step times."""
    interval_s: float = POLL_INTERVAL_S
    """Seconds between polls."""
    max_gap_s: float = MAX_GAP_S
    """The most silence one gap between polls adds."""
    step_window: int = STEP_WINDOW
    """Recent step durations kept for the median."""

    def __post_init__(self) -> None:
        for name in ("floor_s", "step_factor", "interval_s", "max_gap_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.step_window < 1:
            raise ValueError(f"step_window: must be >= 1, got {self.step_window}")
        if self.max_gap_s < self.interval_s:
            raise ValueError(
                f"max_gap_s ({self.max_gap_s}) must be at least interval_s ({self.interval_s})"
            )
        if not self.node:
            raise ValueError("node: must not be empty")


def threshold_s(
    step_durations: Iterable[float], *, floor_s: float, factor: float = STEP_FACTOR
) -> float:
    """Silence that makes a worker frozen: ``max(floor_s, factor x median step duration)``."""
    durations = list(step_durations)
    return max(floor_s, factor * statistics.median(durations)) if durations else floor_s


@dataclass(frozen=True, slots=True)
class FrozenWorker:
    """A worker the tracker found frozen."""

    pid: int
    rank: int
    local_rank: int
    start_ticks: int
    silent_s: float
    """How long its beat had not changed, on the watchdog's clock."""
    threshold_s: float
    last_step: int | None


@dataclass(slots=True)
class _Slot:
    rank: int
    local_rank: int
    beats: int
    silent_s: float = 0.0
    step: int | None = None
    step_ns: int = 0
    reported: bool = False


@dataclass(slots=True)
class StallTracker:
    """Per-worker beat progress and recent step durations; decides who is frozen (no I/O).

    Feed it every poll's readings of the live workers' slots with :meth:`observe`.
    """

    config: WatchdogConfig
    _slots: dict[tuple[int, int], _Slot] = field(default_factory=dict)
    _durations: deque[float] = field(init=False)
    _last_poll: float | None = None

    def __post_init__(self) -> None:
        self._durations = deque(maxlen=self.config.step_window)

    @property
    def step_durations(self) -> list[float]:
        """Recent per-step durations, seconds (from the workers' own step times)."""
        return list(self._durations)

    def threshold_s(self) -> float:
        return threshold_s(
            self._durations, floor_s=self.config.floor_s, factor=self.config.step_factor
        )

    def observe(self, readings: Iterable[SlotReading], now: float) -> list[FrozenWorker]:
        """Take one poll's readings (``now``: the watchdog's ``time.monotonic()``); return the
        workers newly found frozen. Each worker is returned once; workers missing from
        ``readings`` are forgotten."""
        gap = (
            0.0
            if self._last_poll is None
            else min(max(0.0, now - self._last_poll), self.config.max_gap_s)
        )
        self._last_poll = now
        seen: set[tuple[int, int]] = set()
        for reading in readings:
            key = (reading.pid, reading.start_ticks)
            seen.add(key)
            slot = self._slots.get(key)
            if slot is None:
                self._slots[key] = _Slot(
                    rank=reading.rank,
                    local_rank=reading.local_rank,
                    beats=reading.beats,
                    step=reading.step,
                    step_ns=reading.step_ns,
                )
                continue
            if reading.beats != slot.beats:
                slot.beats, slot.silent_s = reading.beats, 0.0
            else:
                slot.silent_s += gap
            self._note_step(slot, reading)
        for key in set(self._slots) - seen:
            del self._slots[key]
        threshold = self.threshold_s()
        frozen = []
        for (pid, start_ticks), slot in self._slots.items():
            if slot.silent_s > threshold and not slot.reported:
                slot.reported = True
                frozen.append(
                    FrozenWorker(
                        pid=pid,
                        rank=slot.rank,
                        local_rank=slot.local_rank,
                        start_ticks=start_ticks,
                        silent_s=slot.silent_s,
                        threshold_s=threshold,
                        last_step=slot.step,
                    )
                )
        return frozen

    def _note_step(self, slot: _Slot, reading: SlotReading) -> None:
        if reading.step is None:
            return
        if slot.step is not None and reading.step > slot.step and reading.step_ns > slot.step_ns:
            self._durations.append(
                (reading.step_ns - slot.step_ns) / 1e9 / (reading.step - slot.step)
            )
        slot.step, slot.step_ns = reading.step, reading.step_ns  # a rollback re-baselines


# -- the watchdog's I/O ------------------------------------------------------------------------------
def process_state(pid: int) -> tuple[int, str] | None:
    """``(start time in clock ticks, state letter)`` of process ``pid``; ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[-1].split()
        return int(fields[19]), fields[0].decode("ascii", "replace")
    except (OSError, IndexError, ValueError):
        return None


def is_running(pid: int, start_ticks: int) -> bool:
    """Whether the process a slot describes still runs: same start time, not a zombie."""
    state = process_state(pid)
    if state is None:
        return False
    started, letter = state
    return letter not in ("Z", "X") and (start_ticks == 0 or started == start_ticks)


def stop_worker(worker: FrozenWorker) -> bool:
    """SIGKILL a frozen worker (SIGKILL also ends a stopped process): its process group when it
    leads its own (torchrun and the warm server start each worker in a new session), else the
    process. Returns False when it was already gone."""
    if not is_running(worker.pid, worker.start_ticks):
        return False  # gone, or its pid names another process by now
    try:
        group = os.getpgid(worker.pid)
        if group == worker.pid and group != os.getpgrp():
            os.killpg(group, signal.SIGKILL)
        else:
            os.kill(worker.pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


class FrozenWorkerWatchdog:
    """The launcher thread (see the module docstring).

    Args:
        config: directory, node name and thresholds.
        on_frozen: called once per frozen worker it stopped (the node's counter).
        clock: ``time.monotonic`` (tests inject their own).
        stop_worker: how a frozen worker is stopped (tests inject their own).
    """

    def __init__(
        self,
        config: WatchdogConfig,
        *,
        on_frozen: Callable[[FrozenWorker], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        stop_worker: Callable[[FrozenWorker], bool] = stop_worker,
    ) -> None:
        self.config = config
        self.tracker = StallTracker(config)
        self._on_frozen = on_frozen
        self._clock = clock
        self._stop_worker = stop_worker
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error: str | None = None

    def start(self) -> None:
        """Start polling on a daemon thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="elastic-trainer-watchdog", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop polling (bounded wait). Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - the thread must outlive a bad poll; said once per kind
                message = f"{type(exc).__name__}: {exc}"
                if message != self._last_error:
                    self._last_error = message
                    log.error(
                        "frozen-worker watchdog: a poll of %s failed (%s); retrying every %g s",
                        self.config.directory,
                        message,
                        self.config.interval_s,
                    )
            else:
                self._last_error = None

    def read_slots(self) -> list[SlotReading]:
        """The slots of running workers; slots of processes that are gone are removed."""
        readings = []
        for path in self.config.directory.glob("*" + SLOT_SUFFIX):
            reading = read_slot(path)
            if reading is None:
                continue  # vanished between listing and reading, or not a slot
            if not is_running(reading.pid, reading.start_ticks):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            readings.append(reading)
        return readings

    def poll(self) -> list[FrozenWorker]:
        """One pass: read the slots, decide, stop the frozen workers; returns those stopped."""
        frozen = self.tracker.observe(self.read_slots(), self._clock())
        stopped = []
        for worker in frozen:
            if not self._stop_worker(worker):
                log.info(
                    "worker rank %d (pid %d) exited after %.1f s without a beat, before it was stopped",
                    worker.rank,
                    worker.pid,
                    worker.silent_s,
                )
                continue
            log.warning(
                "worker rank %d (pid %d) on node %s made no progress for %.1f s (frozen); "
                "stopping it so the job heals",
                worker.rank,
                worker.pid,
                self.config.node,
                worker.silent_s,
            )
            stopped.append(worker)
            if self._on_frozen is not None:
                self._on_frozen(worker)
        return stopped
