"""The frozen-worker watchdog: threshold math, the stall decisions on a fake clock, and the
watchdog on real processes (frozen by SIGSTOP or a held GIL; blocked in C; gone) with a 1 s floor.
Also its option (``--frozen-timeout``) and its counter on the node's registry."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from elastic_trainer.launch.node_metrics import FrozenWorkerMetrics
from elastic_trainer.launch.options import UserError, resolve_run_options
from elastic_trainer.launch.watchdog import (
    FrozenWorker,
    FrozenWorkerWatchdog,
    StallTracker,
    WatchdogConfig,
    is_running,
    stop_worker,
    threshold_s,
)
from elastic_trainer.ops.processes import wait_for
from elastic_trainer.runtime.heartbeat import (
    HEADER,
    MAGIC,
    SLOT_SIZE,
    VERSION,
    SlotReading,
    process_start_ticks,
    read_slot,
    slot_path,
)
from elastic_trainer.runtime.settings import ENV_HEARTBEAT_DIR

REPO = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, **overrides: float) -> WatchdogConfig:
    values = {"floor_s": 10.0, "interval_s": 0.5, "max_gap_s": 2.0, **overrides}
    return WatchdogConfig(directory=tmp_path, node="n1", **values)  # type: ignore[arg-type]


def reading(
    pid: int = 100,
    beats: int = 0,
    *,
    step: int | None = None,
    step_s: float = 0.0,
    start_ticks: int = 7,
    rank: int = 1,
) -> SlotReading:
    return SlotReading(
        pid=pid,
        rank=rank,
        local_rank=0,
        start_ticks=start_ticks,
        beats=beats,
        beat_ns=0,
        step=step,
        step_ns=int(step_s * 1e9) if step is not None else 0,
    )


# -- the decision, on a fake clock -----------------------------------------------------------------
def test_threshold_is_the_floor_or_five_median_steps() -> None:
    assert threshold_s([], floor_s=10.0) == 10.0
    assert threshold_s([0.05, 0.04, 0.06], floor_s=10.0) == 10.0
    assert threshold_s([3.0, 3.0, 2.0, 100.0], floor_s=10.0) == 15.0  # median 3, not the outlier
    assert threshold_s([4.0], floor_s=1.0, factor=2.0) == 8.0


def test_config_names_a_bad_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="floor_s"):
        config(tmp_path, floor_s=0)
    with pytest.raises(ValueError, match="max_gap_s"):
        config(tmp_path, interval_s=1.0, max_gap_s=0.5)


def test_silence_counts_only_while_the_beat_stands_still(tmp_path: Path) -> None:
    tracker = StallTracker(config(tmp_path, floor_s=10.0))
    now, beats = 0.0, 0
    for _ in range(40):  # 20 s of a live worker: beats every poll
        beats += 1
        assert tracker.observe([reading(beats=beats)], now) == []
        now += 0.5
    for _ in range(20):  # 10 s without a beat: exactly at the threshold, not past it
        assert tracker.observe([reading(beats=beats)], now) == []
        now += 0.5
    frozen = tracker.observe([reading(beats=beats)], now)
    assert [(w.pid, w.rank, w.silent_s, w.threshold_s) for w in frozen] == [(100, 1, 10.5, 10.0)]
    assert tracker.observe([reading(beats=beats)], now + 0.5) == [], "reported once"


def test_a_beat_resets_the_silence(tmp_path: Path) -> None:
    tracker = StallTracker(config(tmp_path, floor_s=2.0))
    for i in range(8):  # 3.5 s, beating every 1.5 s: never 2 s silent
        assert tracker.observe([reading(beats=i // 3)], i * 0.5) == []


def test_time_the_watchdog_did_not_watch_is_not_silence(tmp_path: Path) -> None:
    """The launcher itself paused (SIGSTOP, a starved thread) for 100 s: one gap adds max_gap_s."""
    tracker = StallTracker(config(tmp_path, floor_s=10.0, max_gap_s=2.0))
    tracker.observe([reading(beats=5)], 0.0)
    assert tracker.observe([reading(beats=5)], 100.0) == []
    now = 100.0
    while not tracker.observe([reading(beats=5)], now):
        now += 0.5
    assert now == pytest.approx(100.0 + 8.5)  # 2 s counted for the pause, then 8.5 s watched


def test_slow_steps_raise_the_threshold(tmp_path: Path) -> None:
    """A job whose steps take 4 s: a worker may be silent up to 20 s (5 x 4 s), not just 10 s."""
    tracker = StallTracker(config(tmp_path, floor_s=10.0))
    for i in range(5):
        tracker.observe([reading(beats=i, step=i, step_s=4.0 * i)], 4.0 * i)
    assert tracker.step_durations == [4.0] * 4 and tracker.threshold_s() == 20.0
    now = 16.0
    while not tracker.observe([reading(beats=4, step=4, step_s=16.0)], now):
        now += 0.5
    assert now - 16.0 == 20.5


def test_step_durations_per_step_rollbacks_and_torn_reads(tmp_path: Path) -> None:
    tracker = StallTracker(config(tmp_path))
    tracker.observe([reading(beats=1, step=10, step_s=1.0)], 0.0)
    tracker.observe([reading(beats=2, step=20, step_s=2.0)], 0.5)  # 10 steps in 1 s
    tracker.observe([reading(beats=3, step=None)], 1.0)  # a read that raced a write
    tracker.observe([reading(beats=4, step=15, step_s=3.0)], 1.5)  # rolled back: a new baseline
    tracker.observe([reading(beats=5, step=16, step_s=3.5)], 2.0)
    assert tracker.step_durations == pytest.approx([0.1, 0.5])


def test_a_new_process_behind_a_known_pid_starts_afresh_and_gone_ones_are_forgotten(
    tmp_path: Path,
) -> None:
    tracker = StallTracker(config(tmp_path, floor_s=1.0))
    tracker.observe([reading(pid=1, beats=3), reading(pid=2, beats=3)], 0.0)
    tracker.observe([reading(pid=1, beats=3), reading(pid=2, beats=4)], 0.5)
    # pid 1 now belongs to a new process (another start time): it has not been silent at all.
    assert (
        tracker.observe([reading(pid=1, beats=3, start_ticks=99), reading(pid=2, beats=5)], 1.0)
        == []
    )
    assert (
        tracker.observe([reading(pid=1, beats=3, start_ticks=99), reading(pid=2, beats=6)], 1.5)
        == []
    )
    frozen = tracker.observe(
        [reading(pid=1, beats=3, start_ticks=99), reading(pid=2, beats=7)], 2.5
    )
    assert [(w.pid, w.start_ticks) for w in frozen] == [(1, 99)]


# -- real processes ----------------------------------------------------------------------------------
BLOCKERS = {
    "sigstop": "import time; time.sleep(120)",  # stopped by the test
    "gil_held": "import ctypes; ctypes.PyDLL(None).sleep(120)",  # a deadlock with the GIL held
    "c_call": "import ctypes; ctypes.CDLL(None).sleep(120)",  # waiting in C, GIL released (a collective)
}


class Worker:
    """A process that beats like a worker (rank 1) in ``directory``; it blocks once :meth:`block` is called."""

    def __init__(self, directory: Path, blocker: str, *, new_session: bool = True) -> None:
        self.directory = directory
        self.trigger = directory.parent / f"block-{blocker}-{time.monotonic_ns()}"
        code = (
            "from elastic_trainer.runtime import heartbeat; heartbeat.start_from_environ(); import os, time\n"
            f"while not os.path.exists({str(self.trigger)!r}): time.sleep(0.02)\n"
            + BLOCKERS[blocker]
        )
        env = dict(
            os.environ, **{ENV_HEARTBEAT_DIR: str(directory), "RANK": "1", "LOCAL_RANK": "0"}
        )
        # Like torchrun and the warm server: each worker leads its own session.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], env=env, cwd=REPO, start_new_session=new_session
        )
        self.blocker = blocker

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_beating(self) -> None:
        def beating() -> bool:
            assert self.proc.poll() is None, f"the worker exited with {self.proc.returncode}"
            found = read_slot(slot_path(self.directory, self.pid))
            return found is not None and found.beats >= 1

        wait_for(beating, timeout=30, what="the worker's first beat")

    def block(self) -> float:
        """Make it block (or SIGSTOP it); returns ``time.monotonic()`` then."""
        self.trigger.touch()
        time.sleep(0.2)
        if self.blocker == "sigstop":
            os.kill(self.pid, signal.SIGSTOP)
        return time.monotonic()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def slots(tmp_path: Path) -> Path:
    directory = tmp_path / "hb"
    directory.mkdir()
    return directory


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    try:
        yield started
    finally:
        for worker in started:
            worker.close()


@pytest.fixture
def watchdog(slots: Path) -> Iterator[tuple[FrozenWorkerWatchdog, list[FrozenWorker]]]:
    stopped: list[FrozenWorker] = []
    dog = FrozenWorkerWatchdog(
        config(slots, floor_s=1.0, interval_s=0.1, max_gap_s=0.5), on_frozen=stopped.append
    )
    dog.start()
    try:
        yield dog, stopped
    finally:
        dog.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("blocker", ["sigstop", "gil_held"])
def test_a_frozen_worker_is_named_stopped_and_counted(
    slots: Path,
    workers: list[Worker],
    watchdog: tuple[FrozenWorkerWatchdog, list[FrozenWorker]],
    caplog: pytest.LogCaptureFixture,
    blocker: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="elastic_trainer.launch.watchdog")
    _, stopped = watchdog
    worker = Worker(slots, blocker)
    workers.append(worker)
    worker.wait_beating()
    frozen_at = worker.block()
    assert worker.proc.wait(30) == -signal.SIGKILL
    took = time.monotonic() - frozen_at
    assert [(w.pid, w.rank) for w in stopped] == [(worker.pid, 1)]
    assert took >= 0.4, (
        f"stopped {took:.2f} s after it froze, before the 1 s floor (less a beat) had passed"
    )
    lines = [r.getMessage() for r in caplog.records if "frozen" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"worker rank 1 (pid {worker.pid}) on node n1 made no progress for ")
    assert lines[0].endswith(" s (frozen); stopping it so the job heals")
    wait_for(
        lambda: not slot_path(slots, worker.pid).exists(),
        timeout=10,
        what="the dead worker's slot to go",
    )


@pytest.mark.timeout(60)
def test_workers_blocked_in_c_or_merely_slow_are_never_stopped(
    slots: Path,
    workers: list[Worker],
    watchdog: tuple[FrozenWorkerWatchdog, list[FrozenWorker]],
) -> None:
    dog, stopped = watchdog
    blocked = Worker(slots, "c_call")
    workers.append(blocked)
    blocked.wait_beating()
    blocked.block()
    time.sleep(4.0)  # four times the floor
    assert blocked.proc.poll() is None and stopped == []
    assert dog.tracker.threshold_s() == 1.0


@pytest.mark.timeout(60)
def test_slots_of_gone_processes_are_removed_and_never_acted_on(
    slots: Path,
    watchdog: tuple[FrozenWorkerWatchdog, list[FrozenWorker]],
) -> None:
    _, stopped = watchdog
    # A worker that died without removing its slot (SIGKILL): spawn one and kill it.
    code = "from elastic_trainer.runtime import heartbeat; heartbeat.start_from_environ(); import time; time.sleep(60)"
    env = dict(os.environ, **{ENV_HEARTBEAT_DIR: str(slots)})
    dead = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO)
    try:
        wait_for(lambda: slot_path(slots, dead.pid).exists(), timeout=30, what="its slot")
    finally:
        dead.kill()
        dead.wait(10)
    assert slot_path(slots, dead.pid).exists(), "SIGKILL leaves the slot behind"
    # A slot naming a live pid -- this test's own -- with another start time: the pid was reused.
    reused = slot_path(slots, os.getpid())
    image = bytearray(SLOT_SIZE)
    HEADER.pack_into(
        image,
        0,
        MAGIC,
        VERSION,
        0,
        os.getpid(),
        0,
        0,
        0,
        (process_start_ticks(os.getpid()) or 0) + 1,
    )
    reused.write_bytes(bytes(image))
    wait_for(lambda: not any(slots.iterdir()), timeout=10, what="both slots to be removed")
    time.sleep(1.5)
    assert stopped == []


@pytest.mark.timeout(60)
def test_stop_worker_kills_the_workers_process_group() -> None:
    """A worker's children (DataLoader workers) share its group and go with it."""
    code = (
        "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(60)']); print(child.pid, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGSTOP)
        started = process_start_ticks(proc.pid) or 0
        assert stop_worker(
            FrozenWorker(
                pid=proc.pid,
                rank=0,
                local_rank=0,
                start_ticks=started,
                silent_s=1.0,
                threshold_s=1.0,
                last_step=None,
            )
        )
        assert proc.wait(10) == -signal.SIGKILL
        wait_for(lambda: not is_running(child, 0), timeout=10, what="the worker's child to die")
    finally:
        proc.kill()
        proc.wait(10)


def test_stop_worker_leaves_a_reused_pid_alone() -> None:
    me = FrozenWorker(
        pid=os.getpid(),
        rank=0,
        local_rank=0,
        start_ticks=(process_start_ticks(os.getpid()) or 0) + 1,
        silent_s=1.0,
        threshold_s=1.0,
        last_step=None,
    )
    assert stop_worker(me) is False  # and this test is still running


# -- the option and the counter ----------------------------------------------------------------------
def test_frozen_timeout_option() -> None:
    assert resolve_run_options({}, env={}).frozen_timeout == 10.0
    assert resolve_run_options({"frozen_timeout": "0"}, env={}).frozen_timeout == 0.0
    assert (
        resolve_run_options({}, env={"ELASTIC_TRAINER_FROZEN_TIMEOUT": "30"}).frozen_timeout == 30.0
    )
    for bad in ("0.5", "-1", "nan", "inf", "soon"):  # one line each, naming the option
        with pytest.raises(UserError, match="--frozen-timeout") as caught:
            resolve_run_options({"frozen_timeout": bad}, env={})
        assert "\n" not in str(caught.value)
    with pytest.raises(
        UserError,
        match=r"ELASTIC_TRAINER_FROZEN_TIMEOUT: bad value 'soon' \(not a number of seconds\)",
    ):
        resolve_run_options({}, env={"ELASTIC_TRAINER_FROZEN_TIMEOUT": "soon"})


def test_frozen_worker_counter() -> None:
    registry = CollectorRegistry()
    counter = FrozenWorkerMetrics(run_id="job-1", node="n1", registry=registry)
    labels = {"run_id": "job-1", "node": "n1"}
    assert registry.get_sample_value("elastic_trainer_frozen_workers_total", labels) == 0
    counter.stopped()
    counter.stopped()
    assert registry.get_sample_value("elastic_trainer_frozen_workers_total", labels) == 2
