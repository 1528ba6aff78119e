"""The worker's heartbeat slot: its layout, the module-level API, and real processes that beat.

The process tests start small Python processes that only start a heartbeat and then block: in a
C call that releases the GIL (they keep beating), in one that holds it (they stop), or stopped by
SIGSTOP (they stop).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_trainer.ops.processes import wait_for
from elastic_trainer.runtime import heartbeat
from elastic_trainer.runtime.heartbeat import (
    HEADER,
    MAGIC,
    SLOT_SIZE,
    VERSION,
    Heartbeat,
    SlotReading,
    read_slot,
    slot_path,
)
from elastic_trainer.runtime.settings import ENV_HEARTBEAT_DIR

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_heartbeat_left() -> Iterator[None]:
    heartbeat.stop()
    try:
        yield
    finally:
        heartbeat.stop()


def test_slot_round_trip(tmp_path: Path) -> None:
    beat = Heartbeat(tmp_path, rank=3, local_rank=1)
    try:
        first = read_slot(beat.path)
        assert first is not None
        assert (first.pid, first.rank, first.local_rank) == (os.getpid(), 3, 1)
        assert (
            first.start_ticks == heartbeat.process_start_ticks(os.getpid())
            and first.start_ticks > 0
        )
        assert (first.beats, first.step) == (0, None)
        before = time.monotonic_ns()
        beat.beat()
        beat.note_step(7)
        second = read_slot(beat.path)
        assert second is not None
        assert second.beats == 1 and second.step == 7
        assert before <= second.beat_ns <= time.monotonic_ns()
        assert before <= second.step_ns <= time.monotonic_ns()
        assert beat.path == slot_path(tmp_path, os.getpid())
        assert beat.path.stat().st_size == SLOT_SIZE
        assert [p.name for p in tmp_path.iterdir()] == [beat.path.name], "no staging file left"
    finally:
        beat.close()
    assert not beat.path.exists(), "close removes the slot"
    beat.close()  # idempotent


def test_layout_is_fixed() -> None:
    """Launcher and workers of one node may run different builds of this module only if the layout
    stays put: a change must bump VERSION."""
    assert (HEADER.size, SLOT_SIZE, VERSION, MAGIC) == (32, 72, 1, b"ETHB")


def test_a_torn_step_pair_reads_as_no_step(tmp_path: Path) -> None:
    beat = Heartbeat(tmp_path, rank=0, local_rank=0)
    try:
        beat.note_step(5)
        data = bytearray(beat.path.read_bytes())
        data[SLOT_SIZE - 8 :] = (6).to_bytes(8, sys.byteorder)  # a write of step 6 caught half-way
        torn = tmp_path / "torn.slot"
        torn.write_bytes(bytes(data))
        reading = read_slot(torn)
        assert reading is not None and reading.step is None and reading.step_ns == 0
    finally:
        beat.close()


def test_what_is_not_a_slot_reads_as_none(tmp_path: Path) -> None:
    assert read_slot(tmp_path / "missing.slot") is None
    short = tmp_path / "short.slot"
    short.write_bytes(b"ETHB")
    assert read_slot(short) is None
    other = tmp_path / "other.slot"
    other.write_bytes(b"XXXX" + bytes(SLOT_SIZE - 4))
    assert read_slot(other) is None


def test_off_without_the_environment_variable() -> None:
    assert heartbeat.start_from_environ({}) is None
    assert heartbeat.current() is None
    heartbeat.note_step(1)  # a no-op, not an error


def test_start_from_environ_is_idempotent_and_beats(tmp_path: Path) -> None:
    env = {ENV_HEARTBEAT_DIR: str(tmp_path), "RANK": "5", "LOCAL_RANK": "1"}
    started = heartbeat.start_from_environ(env)
    assert started is not None and heartbeat.start_from_environ(env) is started

    def two_beats() -> SlotReading | None:
        found = read_slot(started.path)
        return found if found is not None and found.beats >= 2 else None

    reading = wait_for(two_beats, timeout=10, what="two beats")
    assert (reading.rank, reading.local_rank) == (5, 1)
    heartbeat.note_step(42)
    after = read_slot(started.path)
    assert after is not None and after.step == 42
    heartbeat.stop()
    assert heartbeat.current() is None and not started.path.exists()


def test_the_signal_wakeup_waits_on_the_beat_thread(tmp_path: Path) -> None:
    """Under ``elastic-trainer run`` a worker beats: the graceful stop's signal wakeup then reads
    its pipe on the beat thread (no thread of its own), a signal reaches its callback there at
    once, the beats go on, and after ``uninstall`` the beat thread no longer reads the pipe."""
    import threading

    from elastic_trainer.runtime.signals import SignalWakeup

    env = {ENV_HEARTBEAT_DIR: str(tmp_path), "RANK": "0", "LOCAL_RANK": "0"}
    started = heartbeat.start_from_environ(env)
    assert started is not None
    got: list[tuple[int, str]] = []
    # CPython writes the wakeup byte only for a signal with a Python handler.
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    wakeup = SignalWakeup(
        lambda signum: got.append((signum, threading.current_thread().name)),
        signals=(signal.SIGUSR1,),
    )
    try:
        wakeup.install()
        assert wakeup.installed
        assert not [t for t in threading.enumerate() if t.name == "signal-wakeup"]
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: got, timeout=5.0, what="the wakeup reported the signal")
        assert got == [(signal.SIGUSR1, "elastic-trainer-heartbeat")]
        first = read_slot(started.path)
        assert first is not None

        def two_more_beats() -> bool:
            now = read_slot(started.path)
            return now is not None and now.beats >= first.beats + 2

        wait_for(two_more_beats, timeout=5.0, what="the beats go on")
    finally:
        wakeup.uninstall()
        signal.signal(signal.SIGUSR1, previous)
    assert not wakeup.installed and started._watched == {}
    beats = read_slot(started.path)
    assert beats is not None
    wait_for(
        lambda: (now := read_slot(started.path)) is not None and now.beats > beats.beats,
        timeout=5.0,
        what="a beat after the wakeup left",
    )


def test_an_unusable_directory_is_one_line_and_no_heartbeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert heartbeat.start_from_environ({ENV_HEARTBEAT_DIR: str(tmp_path / "missing")}) is None
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no heartbeat for this worker" in err and "missing" in err


def test_a_forked_child_never_writes_into_its_parents_slot(tmp_path: Path) -> None:
    started = heartbeat.start_from_environ({ENV_HEARTBEAT_DIR: str(tmp_path)})
    assert started is not None
    heartbeat.note_step(3)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0 if heartbeat.current() is None else 1
        heartbeat.note_step(99)
        heartbeat.stop()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child still held its parent's heartbeat"
    reading = read_slot(started.path)
    assert reading is not None and reading.step == 3, "the child wrote into the parent's slot"


# -- real processes ------------------------------------------------------------------------------
BLOCKERS = {
    # ctypes.CDLL releases the GIL during the call: blocked in C, like a collective waiting for a peer.
    "c_call": "import ctypes; ctypes.CDLL(None).sleep(60)",
    # ctypes.PyDLL holds it: like a deadlock with the GIL held.
    "gil_held": "import ctypes; ctypes.PyDLL(None).sleep(60)",
    "python_sleep": "import time; time.sleep(60)",
}


def start_beating(directory: Path, blocker: str) -> tuple[subprocess.Popen[bytes], Path]:
    """A process that starts its heartbeat, waits for the returned trigger file to exist, then
    blocks as ``BLOCKERS[blocker]`` does."""
    trigger = directory.parent / f"block-{blocker}"
    code = (
        "from elastic_trainer.runtime import heartbeat; heartbeat.start_from_environ(); import os, time\n"
        f"while not os.path.exists({str(trigger)!r}): time.sleep(0.02)\n" + BLOCKERS[blocker]
    )
    env = dict(os.environ, **{ENV_HEARTBEAT_DIR: str(directory), "RANK": "1", "LOCAL_RANK": "0"})
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO), trigger


def block(directory: Path, proc: subprocess.Popen[bytes], trigger: Path) -> None:
    """Wait until the process beats, then make it block."""
    wait_for(
        lambda: slot_appeared(directory, proc) and beats(directory, proc.pid) >= 1,
        timeout=30,
        what="the slot and a first beat",
    )
    trigger.touch()
    time.sleep(0.5)  # it polls for the trigger every 20 ms


def beats(directory: Path, pid: int) -> int:
    reading = read_slot(slot_path(directory, pid))
    assert reading is not None, f"no slot for pid {pid}"
    return reading.beats


def slot_appeared(directory: Path, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"the beating process exited with {proc.returncode}"
    return read_slot(slot_path(directory, proc.pid)) is not None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("blocker", ["c_call", "python_sleep"])
def test_a_process_blocked_with_the_gil_released_keeps_beating(
    tmp_path: Path, blocker: str
) -> None:
    slots = tmp_path / "hb"
    slots.mkdir()
    proc, trigger = start_beating(slots, blocker)
    try:
        block(slots, proc, trigger)
        first = beats(slots, proc.pid)
        wait_for(
            lambda: beats(slots, proc.pid) >= first + 2,
            timeout=10,
            what="two more beats while blocked",
        )
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["sigstop", "gil_held"])
def test_a_stopped_or_gil_holding_process_stops_beating(tmp_path: Path, how: str) -> None:
    slots = tmp_path / "hb"
    slots.mkdir()
    proc, trigger = start_beating(slots, "gil_held" if how == "gil_held" else "python_sleep")
    try:
        block(slots, proc, trigger)
        if how == "sigstop":
            proc.send_signal(signal.SIGSTOP)
        frozen = beats(slots, proc.pid)
        time.sleep(2.0)  # four beat intervals
        assert beats(slots, proc.pid) <= frozen + 1, "it went on beating"  # +1: a beat in flight
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)


def test_the_worker_entry_point_starts_the_heartbeat(tmp_path: Path) -> None:
    """Cold and warm-forked workers both run the target through worker_entry.run."""
    script = tmp_path / "job.py"
    script.write_text(
        "from elastic_trainer.runtime import heartbeat\n"
        "import sys\n"
        "beat = heartbeat.current()\n"
        "sys.exit(0 if beat is not None and beat.path.exists() else 3)\n"
    )
    hb_dir = tmp_path / "hb"
    hb_dir.mkdir()
    env = dict(os.environ, **{ENV_HEARTBEAT_DIR: str(hb_dir)})
    done = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.train.worker_entry", str(script)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert list(hb_dir.iterdir()) == [], "a worker that exits removes its slot"
