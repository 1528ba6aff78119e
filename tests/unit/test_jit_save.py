"""Unit tests of the just-in-time saver's parts: the update guard, the one-writer rule, the stall
monitor, the deadline, the buffers kept at one rank, and the configuration switch. Real files, fake
training state."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint import jit as jit_save
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.checkpoint.jit import ExitTimer
from elastic_trainer.runtime.exit_codes import EXIT_STOPPED
from elastic_trainer.runtime.settings import ENV_JIT_SAVE, WorkerSettings
from elastic_trainer.state.buffers import AuthoritativeBuffers
from elastic_trainer.state.guard import StateGuard
from tests.support.just_in_time import just_in_time

pytestmark = pytest.mark.timeout(60)

FIELDS = {"model": [["w", [2], "float32"]], "seed": 0}


class FakeTraining:
    """A training state whose "update" can be paused halfway, and a saver over it."""

    def __init__(self, directory: Path, *, rank: int = 0) -> None:
        self.guard = StateGuard()
        self.step = 0
        self.weights = torch.zeros(2)
        self.exits: list[int] = []
        self.exited = threading.Event()
        self.drained: list[float] = []
        self.jit = just_in_time(
            guard=self.guard,
            directory=str(directory),
            rank=rank,
            step=lambda: self.step,
            payload=self.payload,
            write=lambda step, payload: self.writes(step, payload),
            drain=self.drained.append,
            exit_fn=self.exit,
        )
        self.writes = self.write
        self.jit.arm()

    def update(
        self, *, pause: threading.Event | None = None, entered: threading.Event | None = None
    ) -> None:
        with self.guard.update():
            self.weights += 1  # first half of the update
            if entered is not None:
                entered.set()
            if pause is not None:
                assert pause.wait(20)
            self.step += 1  # second half
        self.guard.boundary()

    def payload(self) -> dict[str, Any]:
        return {"format": ckpt.FORMAT, "model": {"w": self.weights.clone()}, "step": self.step}

    def write(self, step: int, payload: dict[str, Any]) -> str:
        directory = self.jit.directory
        assert directory is not None
        info = ckpt.save_checkpoint(
            directory,
            payload,
            step=step,
            epoch=0,
            world_size=1,
            fingerprint_fields=FIELDS,
            keep_last=None,
            jit=True,
        )
        return str(info.path)

    def exit(self, code: int) -> None:
        self.exits.append(code)
        self.exited.set()


def _saved(path: str | None) -> dict[str, Any]:
    assert path is not None
    return torch.load(path, weights_only=True)


def _deadline(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


# -- the guard ---------------------------------------------------------------------------------------
def test_a_save_requested_during_an_update_waits_for_its_end(tmp_path: Path) -> None:
    training = FakeTraining(tmp_path)
    training.update()
    pause, entered = threading.Event(), threading.Event()
    updater = threading.Thread(target=training.update, kwargs={"pause": pause, "entered": entered})
    updater.start()
    assert entered.wait(10)
    result: list[jit_save.JitOutcome] = []
    saver = threading.Thread(
        target=lambda: result.append(training.jit.save("test", deadline=_deadline()))
    )
    saver.start()
    saver.join(0.3)
    assert saver.is_alive() and not result, "the save must wait while the update is half done"
    pause.set()
    saver.join(10)
    updater.join(10)
    outcome = result[0]
    assert outcome.saved and outcome.step == 2
    state = _saved(outcome.path)
    assert state["step"] == 2 and torch.equal(state["model"]["w"], torch.full((2,), 2.0)), (
        "exactly after step 2"
    )
    assert ckpt.verify(tmp_path, 2).manifest.jit


def test_a_save_while_the_main_thread_is_blocked_outside_an_update_is_immediate(
    tmp_path: Path,
) -> None:
    training = FakeTraining(tmp_path)
    training.update()
    read_fd, write_fd = os.pipe()
    blocked = threading.Thread(
        target=os.read, args=(read_fd, 1)
    )  # a blocking C call, as a collective is
    blocked.start()
    try:
        started = time.monotonic()
        outcome = training.jit.save("test", deadline=_deadline())
        took = time.monotonic() - started
    finally:
        os.write(write_fd, b"x")
        blocked.join(10)
        os.close(read_fd)
        os.close(write_fd)
    assert outcome.saved and outcome.step == 1
    assert took < 2.0, f"the save waited {took:.2f} s for a thread that holds no lock"


def test_an_exception_inside_an_update_makes_the_state_unsaveable(tmp_path: Path) -> None:
    training = FakeTraining(tmp_path)
    with pytest.raises(RuntimeError), training.guard.update():
        training.weights += 1
        raise RuntimeError("optimizer step failed halfway")
    outcome = training.jit.save("test", deadline=_deadline())
    assert not outcome.saved and "inside an optimizer update" in outcome.detail
    assert ckpt.iter_checkpoints(tmp_path) == []


def test_guard_not_released_in_time_is_a_failed_save_not_a_hang(tmp_path: Path) -> None:
    training = FakeTraining(tmp_path)
    pause, entered = threading.Event(), threading.Event()
    updater = threading.Thread(target=training.update, kwargs={"pause": pause, "entered": entered})
    updater.start()
    assert entered.wait(10)
    try:
        outcome = training.jit.save("test", deadline=_deadline(0.5))
    finally:
        pause.set()
        updater.join(10)
    assert not outcome.saved and "stayed inside an optimizer update" in outcome.detail
    assert not training.exits, "the deadline timer is cancelled when the save returns"


def test_a_save_is_done_once_whoever_asks(tmp_path: Path) -> None:
    training = FakeTraining(tmp_path)
    training.update()
    first = training.jit.save("first", deadline=_deadline())
    training.update()
    second = training.jit.save("second", deadline=_deadline())
    assert first.saved and second is first and ckpt.iter_checkpoints(tmp_path) == [1]


def test_nothing_is_saved_before_training_started(tmp_path: Path) -> None:
    guard = StateGuard()
    jit = just_in_time(
        guard=guard, directory=str(tmp_path), step=lambda: 0, payload=dict, write=lambda s, p: ""
    )
    outcome = jit.save("test", deadline=_deadline())
    assert not outcome.saved and "had not started" in outcome.detail


def test_a_failure_before_training_started_says_nothing_of_a_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A mistake caught before the first step (an optimizer built after the run started): no
    'saving the last completed step just in time' line ahead of the mistake's own line."""
    jit = just_in_time(
        guard=StateGuard(),
        directory=str(tmp_path),
        step=lambda: 0,
        payload=dict,
        write=lambda s, p: "",
    )
    with caplog.at_level("DEBUG", logger="elastic_trainer.checkpoint.jit"):
        assert jit.after_failure(ValueError("an optimizer the run does not save")) is None
    jit.close()  # the teardown's deadline
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert list(tmp_path.iterdir()) == []


# -- one writer per step -------------------------------------------------------------------------------
_RACER = """
import os, sys, time
from elastic_trainer.checkpoint import files
directory, go, index = sys.argv[1], sys.argv[2], int(sys.argv[3])
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
print("won" if files.try_claim(directory, 7, rank=index) is not None else "lost", flush=True)
"""


def test_exactly_one_process_claims_a_step(tmp_path: Path) -> None:
    # Fresh interpreters, not fork(): a fork of this process (other tests' gRPC and torch threads)
    # can deadlock the child on a lock some thread held.
    go = tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path), str(go), str(i)], stdout=subprocess.PIPE,
                               text=True) for i in range(8)]  # fmt: skip
    try:
        for racer in racers:
            assert racer.stdout is not None and racer.stdout.readline().strip() == "ready"
        go.touch()
        outcomes = [racer.communicate(timeout=60)[0].strip() for racer in racers]
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
                racer.wait()
    winners = [i for i, outcome in enumerate(outcomes) if outcome == "won"]
    assert len(winners) == 1 and outcomes.count("lost") == 7, outcomes
    holder = ckpt.read_claim(tmp_path, 7)
    assert holder is not None and holder["rank"] == winners[0]


def test_a_step_claimed_by_another_writer_is_left_to_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    training = FakeTraining(tmp_path)
    training.update()
    # Written by another process (not this pid): it is writing; do not write the step again.
    ckpt.claim_path(tmp_path, 1).write_text('{"host": "other-node", "pid": 1, "rank": 3}')
    with caplog.at_level(logging.INFO, logger="elastic_trainer.checkpoint.jit"):
        outcome = training.jit.save("test", deadline=_deadline())
    assert (
        not outcome.saved
        and "being written by" in outcome.detail
        and "other-node" in outcome.detail
    )
    assert ckpt.iter_checkpoints(tmp_path) == [] and not training.drained
    assert ckpt.claim_path(tmp_path, 1).exists(), "someone else's claim is not ours to remove"


def test_a_step_claimed_by_this_process_waits_for_its_own_write(tmp_path: Path) -> None:
    training = FakeTraining(tmp_path)
    training.update()
    claim = ckpt.try_claim(tmp_path, 1, rank=0, kind="periodic")  # e.g. the background writer
    assert claim is not None
    outcome = training.jit.save("test", deadline=_deadline())
    assert not outcome.saved and len(training.drained) == 1 and training.drained[0] > 0


def test_an_existing_or_newer_checkpoint_is_not_written_again(tmp_path: Path) -> None:
    training = FakeTraining(tmp_path)
    training.update()
    training.update()
    training.write(
        3, {"format": ckpt.FORMAT, "model": {}, "step": 3}
    )  # written by a faster survivor
    outcome = training.jit.save("test", deadline=_deadline())
    assert not outcome.saved and "a checkpoint of step 3 exists" in outcome.detail
    assert ckpt.iter_checkpoints(tmp_path) == [3]


def test_claims_are_released_after_writing_and_stale_ones_removed_at_start(tmp_path: Path) -> None:
    training = FakeTraining(tmp_path)
    training.update()
    assert training.jit.save("test", deadline=_deadline()).saved
    assert not ckpt.claim_path(tmp_path, 1).exists()
    ckpt.claim_path(tmp_path, 9).write_text("{}")  # a writer killed mid-write
    assert ckpt.remove_stale_claims(tmp_path) == [ckpt.claim_path(tmp_path, 9)]
    assert ckpt.iter_checkpoints(tmp_path) == [1]


def test_jit_writes_do_not_prune_and_manifest_says_jit(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        ckpt.save_checkpoint(
            tmp_path,
            {"format": ckpt.FORMAT, "model": {}},
            step=step,
            epoch=0,
            world_size=1,
            fingerprint_fields=FIELDS,
            keep_last=1,
        )
    assert ckpt.iter_checkpoints(tmp_path) == [3]
    ckpt.save_checkpoint(
        tmp_path,
        {"format": ckpt.FORMAT, "model": {}},
        step=4,
        epoch=0,
        world_size=1,
        fingerprint_fields=FIELDS,
        keep_last=None,
        jit=True,
    )
    assert ckpt.iter_checkpoints(tmp_path) == [3, 4]
    assert ckpt.verify(tmp_path, 4).manifest.jit and not ckpt.verify(tmp_path, 3).manifest.jit


def test_manifest_without_jit_field_still_loads(tmp_path: Path) -> None:
    ckpt.save_checkpoint(
        tmp_path,
        {"format": ckpt.FORMAT, "model": {}},
        step=1,
        epoch=0,
        world_size=1,
        fingerprint_fields=FIELDS,
        keep_last=3,
    )
    path = ckpt.manifest_path(tmp_path, 1)
    path.write_text(path.read_text().replace('"jit": false,', ""))
    assert "jit" not in path.read_text()
    assert ckpt.verify(tmp_path, 1).manifest.jit is False


# -- the stall monitor (signal path) ---------------------------------------------------------------------
@pytest.fixture
def fast_stall(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(jit_save, "STALL_MIN_S", 0.5)  # steps below come every 50 ms: 10x margin
    return 0.5


def test_signal_and_no_step_boundary_saves_and_exits(tmp_path: Path, fast_stall: float) -> None:
    training = FakeTraining(tmp_path)
    training.update()
    started = time.monotonic()
    training.jit.on_signal(signal.SIGTERM)
    assert training.exited.wait(10)
    took = time.monotonic() - started
    assert training.exits == [EXIT_STOPPED]
    assert ckpt.iter_checkpoints(tmp_path) == [1] and ckpt.verify(tmp_path, 1).manifest.jit
    assert fast_stall <= took < fast_stall + 3, took
    assert training.drained, "own background writes are waited for before exiting"


def test_signal_with_steps_still_completing_leaves_the_graceful_path_alone(
    tmp_path: Path, fast_stall: float
) -> None:
    training = FakeTraining(tmp_path)
    training.jit.on_signal(signal.SIGTERM)
    deadline = time.monotonic() + 4 * fast_stall
    while time.monotonic() < deadline:  # steps keep completing, every 50 ms
        training.update()
        assert not training.exited.wait(0.05)
    training.jit.stand_down()  # the ranks agreed to stop; rank 0 checkpoints
    assert not training.exited.wait(4 * fast_stall)
    assert ckpt.iter_checkpoints(tmp_path) == [] and training.exits == []


def test_a_long_checkpoint_write_is_not_a_stall(tmp_path: Path, fast_stall: float) -> None:
    training = FakeTraining(tmp_path)
    training.update()
    training.jit.on_signal(signal.SIGTERM)
    with training.jit.busy():
        assert not training.exited.wait(4 * fast_stall)
    # After the write, steps stop coming: that is a stall again.
    assert training.exited.wait(10) and training.exits == [EXIT_STOPPED]


def test_a_step_this_process_is_still_writing_periodically_is_not_written_again(
    tmp_path: Path,
) -> None:
    """The periodic write of the step in flight (sharded state: no claim): the just-in-time save
    waits for it (bounded), and if it is still in flight leaves the step to it."""
    training = FakeTraining(tmp_path)
    training.update()
    in_flight: list[int | None] = [1]
    jit = just_in_time(
        guard=training.guard,
        directory=str(tmp_path),
        step=lambda: training.step,
        payload=training.payload,
        write=training.write,
        drain=training.drained.append,
        exit_fn=training.exit,
        writing=lambda: in_flight[0],
        own_shards=True,
    )
    jit.arm()
    outcome = jit.save("test", deadline=_deadline())
    assert not outcome.saved and "in flight" in outcome.detail, outcome
    assert training.drained and ckpt.iter_checkpoints(tmp_path) == []


def test_a_thread_that_may_not_read_the_state_saves_nothing_and_does_not_exit(
    tmp_path: Path, fast_stall: float
) -> None:
    """Sharded state with no staged copy: the stall monitor's thread saves nothing (not even
    remembered as the outcome: the training thread may still save) and leaves the exit."""
    training = FakeTraining(tmp_path)
    training.update()
    jit = just_in_time(
        guard=training.guard,
        directory=str(tmp_path),
        step=lambda: training.step,
        payload=training.payload,
        write=training.write,
        exit_fn=training.exit,
        own_shards=True,  # set up on this thread: the training thread
    )
    jit.arm()
    jit.on_signal(signal.SIGTERM)
    assert jit._monitor is not None
    jit._monitor.join(10 * fast_stall)
    assert not jit._monitor.is_alive() and training.exits == []
    assert ckpt.iter_checkpoints(tmp_path) == []
    # The training thread, after a failure.
    assert jit.save("after a failure", deadline=_deadline()).saved


def test_stall_timeout_follows_the_step_time_within_bounds(tmp_path: Path) -> None:
    training = FakeTraining(tmp_path)
    assert training.jit.stall_timeout() == jit_save.STALL_MIN_S
    training.guard._durations.extend([0.01, 2.0, 0.02])
    assert training.jit.stall_timeout() == pytest.approx(6.0)
    training.guard._durations.append(60.0)
    assert training.jit.stall_timeout() == jit_save.STALL_MAX_S


def test_worst_case_fits_torchruns_stop_window() -> None:
    worst = (
        jit_save.STALL_MAX_S
        + jit_save.SAVE_TIMEOUT_S
        + jit_save.BACKSTOP_S
        + jit_save.EXIT_MARGIN_S
    )
    assert worst < jit_save.TORCHRUN_STOP_WINDOW_S


# -- deadlines ---------------------------------------------------------------------------------------------
def test_a_save_that_hangs_ends_the_process_at_its_deadline(tmp_path: Path) -> None:
    training = FakeTraining(tmp_path)
    training.update()
    release = threading.Event()

    def stuck_write(step: int, payload: dict[str, Any]) -> str:
        release.wait(30)  # a hung file system
        return ""

    training.writes = stuck_write
    saver = threading.Thread(
        target=training.jit.save, args=("test",), kwargs={"deadline": _deadline(0.5)}, daemon=True
    )
    started = time.monotonic()
    saver.start()
    try:
        assert training.exited.wait(10)
        assert training.exits == [1] and time.monotonic() - started < 3
    finally:
        release.set()
        saver.join(10)
    assert not ckpt.claim_path(tmp_path, 1).exists(), "the claim is released when the write returns"


def test_exit_timer_cancelled_in_time_does_nothing() -> None:
    codes: list[int] = []
    timer = ExitTimer(0.2, 1, "test", codes.append)
    timer.cancel()
    timer._thread.join(5)
    assert not timer._thread.is_alive() and codes == []


# -- buffers kept without an exchange (one rank) -----------------------------------------------------------
class Stats(torch.nn.Module):
    """Buffers as BatchNorm has them, a float64 one included (its snapshot needs no dtype conversion,
    so only an explicit copy keeps it apart from the committed buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(3, dtype=torch.float64))
        self.register_buffer("var", torch.ones(2))
        self.register_buffer("count", torch.tensor(0, dtype=torch.int64))


def _step(buffers: AuthoritativeBuffers, model: Stats, value: float) -> None:
    """A step at world size 1: the forward changes the buffers, the update commits this rank's copy."""
    with torch.no_grad():
        model.mean.fill_(value)
        model.var.fill_(value)
        model.count.fill_(int(value))
    assert buffers.capture() is None, "nothing to exchange at world size 1"
    buffers.commit(None)


def test_a_snapshot_never_sees_a_later_steps_buffers_and_commits_reuse_one_buffer() -> None:
    model = Stats()
    buffers = AuthoritativeBuffers(model, rank=0, world_size=1)
    _step(buffers, model, 1.0)
    first, source = buffers.snapshot()
    assert source == "rank0" and first["mean"].dtype == torch.float64
    committed = buffers._committed
    assert committed is not None
    _step(buffers, model, 2.0)
    # The next update overwrote the committed buffer in place; the snapshot is a copy.
    assert buffers._committed is committed, "no new tensor per step"
    assert (
        first["mean"].tolist() == [1.0] * 3
        and first["var"].tolist() == [1.0] * 2
        and int(first["count"]) == 1
    )
    # A snapshot between a step's capture and its commit holds the last completed step's buffers.
    with torch.no_grad():
        model.mean.fill_(3.0)
    buffers.capture()
    between, _ = buffers.snapshot()
    assert between["mean"].tolist() == [2.0] * 3 and int(between["count"]) == 2
    # A module replaces a buffer with one of another shape: the committed step keeps its layout
    # until the step in progress commits, in a buffer of its own.
    model.var = torch.full((4,), 5.0)
    buffers.capture()
    assert buffers._committed is committed
    before, _ = buffers.snapshot()
    assert before["var"].tolist() == [2.0] * 2
    buffers.commit(None)
    after, _ = buffers.snapshot()
    assert buffers._committed is not committed and after["var"].tolist() == [5.0] * 4
    assert before["var"].tolist() == [2.0] * 2 and first["mean"].tolist() == [1.0] * 3


# -- configuration --------------------------------------------------------------------------------------
def test_jit_save_is_on_by_default_and_env_turns_it_off() -> None:
    assert WorkerSettings.from_environ({}).jit_save is True
    assert WorkerSettings.from_environ({ENV_JIT_SAVE: "0"}).jit_save is False
    assert CheckpointConfig(jit_save=True).jit_save is True, (
        "the config's value beats the environment's"
    )
    with pytest.raises(ValueError, match="ELASTIC_TRAINER_JIT_SAVE: 'sometimes' is not a boolean"):
        WorkerSettings.from_environ({ENV_JIT_SAVE: "sometimes"})
    with pytest.raises(ValueError, match="checkpoint.jit_save: must be true or false"):
        CheckpointConfig(jit_save="yes")  # type: ignore[arg-type]
