"""Two real gloo processes: a stop signal that arrives while the main thread is blocked inside a
collective still triggers the JIT save (``set_wakeup_fd``), where a flag-only handler would not
even run; every rank can save rank 0's buffers of the last step, also when rank 0 dies before
the step's allreduce; and with those buffers on the step's control allreduce (which the update
waits for), a stop signal ends the run after the step in progress, one step earlier than without.

This file is also the worker script: ``python -m tests.unit.test_jit_save_processes ROLE ...``.
"""

from __future__ import annotations

import json
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
from tests.support.configs import trainer_config

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]


# -- worker side ---------------------------------------------------------------------------------------
def _init(rank: int, work: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=2)


def _blocked_worker(rank: int, work: Path, mode: str) -> None:
    """Rank 0 blocks in an allreduce that rank 1 never joins (rank 1 stays alive, reading stdin)."""
    import torch.distributed as dist

    from elastic_trainer.runtime.signals import GracefulStop, SignalWakeup
    from elastic_trainer.state.guard import StateGuard
    from tests.support.just_in_time import just_in_time

    _init(rank, work)
    if rank == 1:
        (work / "ready-1").write_text("")
        sys.stdin.read()  # until the test closes the pipe
        return
    stop = GracefulStop(60).install()
    guard, state = StateGuard(), {"step": 0, "w": torch.zeros(3)}

    def payload() -> dict[str, Any]:
        # Whether the Python-level handler had run when the snapshot was taken.
        return {
            "format": ckpt.FORMAT,
            "model": {"w": state["w"].clone()},
            "step": state["step"],
            "python_handler_ran": stop.requested,
        }

    def write(step: int, data: dict[str, Any]) -> str:
        info = ckpt.save_checkpoint(
            work / "ckpt",
            data,
            step=step,
            epoch=0,
            world_size=2,
            fingerprint_fields={"seed": 0},
            keep_last=None,
            jit=True,
        )
        return str(info.path)

    jit = just_in_time(
        guard=guard,
        directory=str(work / "ckpt"),
        step=lambda: state["step"],
        payload=payload,
        write=write,
        exit_fn=os._exit,
    )
    if mode == "wakeup":
        SignalWakeup(jit.on_signal).install()
    if mode == "direct":
        threading.Thread(target=_save_once_blocked, args=(jit, work), daemon=True).start()
    jit.arm()
    for _ in range(3):
        with guard.update():
            state["w"] += 1
            state["step"] += 1
        guard.boundary()
    (work / "ready-0").write_text("")
    dist.all_reduce(torch.ones(4))  # blocks: rank 1 never calls it
    (work / "returned").write_text(str(stop.requested))


def _save_once_blocked(jit: Any, work: Path) -> None:
    """Once the main thread sleeps inside the allreduce, save from this thread and time it."""
    _wait_blocked(os.getpid())
    started = time.monotonic()
    outcome = jit.save("direct", deadline=time.monotonic() + 10)
    took = time.monotonic() - started
    (work / "direct.json").write_text(
        json.dumps({"took": took, "saved": outcome.saved, "step": outcome.step})
    )
    os._exit(0)


def _buffers_worker(rank: int, work: Path) -> None:
    import torch.distributed as dist
    from torch import nn

    from elastic_trainer.state.buffers import AuthoritativeBuffers

    _init(rank, work)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model.register_buffer("low", torch.zeros(2, dtype=torch.bfloat16))
    model.register_buffer("big", torch.tensor(0, dtype=torch.int64))
    model.register_buffer(
        "scratch", torch.zeros(1), persistent=False
    )  # not in a state_dict: not saved
    bn = model[1]
    buffers = AuthoritativeBuffers(model, rank=rank, world_size=2)

    def forward(values: float) -> tuple[torch.Tensor, Any]:
        """A step's forward changed this rank's statistics; its control allreduce starts."""
        with torch.no_grad():
            bn.running_mean.copy_(
                torch.tensor([-0.0, 0.0, values]) if rank == 0 else torch.full((3,), values)
            )
            bn.num_batches_tracked.fill_(10 + rank)
            model.low.fill_(values / 3)
            model.big.fill_(2**40 + 1 + rank)
        contribution = buffers.capture()
        assert contribution is not None
        control = torch.cat([torch.zeros(2, dtype=torch.float64), contribution])
        return control, dist.all_reduce(control, async_op=True)

    def update(control: torch.Tensor, handle: Any) -> None:
        handle.wait()  # as the trainer: no update before the allreduce completed
        buffers.commit(control[2:])
        with torch.no_grad():
            bn.running_mean.fill_(-5.0)  # the next step's forward changes the live buffers

    def saved() -> dict[str, Any]:
        state, source = buffers.snapshot()
        if not state:
            return {"source": source}  # nothing committed
        assert "scratch" not in state
        mean = state["1.running_mean"]
        return {
            "mean": mean.tolist(),
            "negative_zero": torch.signbit(mean).tolist(),
            "count": int(state["1.num_batches_tracked"]),
            "half": state["low"].float().tolist(),
            "half_dtype": str(state["low"].dtype),
            "big": int(state["big"]),
            "source": source,
        }

    results: dict[str, Any] = {}
    with torch.no_grad():
        bn.running_mean.fill_(0.5)
    buffers.capture(identical=True)  # the start: every rank holds the same state
    results["round0"] = saved()
    # Round 1: every rank saves rank 0's buffers of the step, bit for bit (signs of zero included).
    update(*forward(1.0))
    results["round1"] = saved()
    # Round 2: rank 0 "dies" before its allreduce: rank 1 has not updated, and still saves rank
    # 0's buffers of round 1 (its weights are round 1's too), not its own of round 2.
    if rank == 1:
        control, handle = forward(7.0)
        results["round2"] = saved()
        (work / "observed").write_text("")
        handle.wait()  # rank 0 joins late, so both processes end cleanly
    else:
        deadline = time.monotonic() + 30
        while not (work / "observed").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        forward(7.0)[1].wait()
    (work / f"buffers-{rank}.json").write_text(json.dumps(results))


SIGNAL_STEP = 4
"""The stop test's rank 1 SIGTERMs itself during the forward of this step (one micro-batch a step)."""


def _stop_worker(rank: int, work: Path, jit: str) -> None:
    """Both ranks run the Trainer (BatchNorm model); rank 1 gets a SIGTERM in step SIGNAL_STEP."""
    from torch import nn
    from torch.utils.data import TensorDataset

    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.train.trainer import Trainer, TrainingJob

    _init(rank, work)

    class SignalAt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.forwards = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.forwards += 1
            if rank == 1 and self.forwards == SIGNAL_STEP:
                os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this forward returns
            return x

    def data() -> TensorDataset:
        x = torch.randn(64, 6, generator=torch.Generator().manual_seed(3))
        return TensorDataset(x, (x.sum(1) > 0).long())

    job = TrainingJob(
        model=lambda: nn.Sequential(
            nn.Linear(6, 8), nn.BatchNorm1d(8), SignalAt(), nn.Linear(8, 2)
        ),
        dataset=data,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss=nn.CrossEntropyLoss(),
    )
    from elastic_trainer.train.config import DDPOptions

    config = trainer_config(
        global_batch_size=8,
        max_steps=20,
        epochs=5,
        log_every=1000,
        checkpoint_every=1000,
        checkpoint_dir=str(work / "ckpt"),
        jit_save=jit == "on",
        ddp=DDPOptions(broadcast_buffers=jit != "off-unsynced"),
    )
    env = read_env(environ={"RANK": str(rank), "WORLD_SIZE": "2"}, cuda_devices=0, backend="gloo")
    trainer = Trainer(config, job, env=env)
    result = trainer.fit()
    exchanged = (
        trainer.checkpoints.state.buffers is not None and trainer.checkpoints.state.buffers.exchange
    )
    (work / f"stop-{rank}.json").write_text(
        json.dumps(
            {"step": result.step, "signal": result.stopped_by_signal, "exchanged": exchanged}
        )
    )


def _main(argv: list[str]) -> None:
    role, rank, work = argv[0], int(argv[1]), Path(argv[2])
    if role == "blocked":
        _blocked_worker(rank, work, argv[3])
    elif role == "buffers":
        _buffers_worker(rank, work)
    elif role == "stop":
        _stop_worker(rank, work, argv[3])
    # Skip interpreter teardown: tearing gloo down without destroy_process_group can abort.
    sys.stdout.flush()
    os._exit(0)


# -- test side ---------------------------------------------------------------------------------------------
def _spawn(
    role: str, rank: str, *args: str, work: Path, stdin: int | None = None
) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    log = open(work / f"log-{role}-{rank}.txt", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, "-m", "tests.unit.test_jit_save_processes", role, rank, str(work), *args],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=stdin,
    )


def _run_pair(role: str, *args: str, work: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Run ranks 0 and 1 of ``role`` to the end; both must exit 0. Their JSON results and logs."""
    procs = [_spawn(role, str(rank), *args, work=work) for rank in (0, 1)]
    try:
        codes = [p.wait(60) for p in procs]
    finally:
        _stop(*procs)
    logs = [(work / f"log-{role}-{r}.txt").read_text() for r in (0, 1)]
    assert codes == [0, 0], logs
    return [json.loads((work / f"{role}-{r}.json").read_text()) for r in (0, 1)], logs


def _wait_for(path: Path, timeout: float, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise AssertionError(f"{path.name} never appeared")
        time.sleep(0.02)


def _wait_blocked(pid: int, polls: int = 5) -> None:
    """Until the main thread of ``pid`` has been asleep (state S) for ``polls`` polls in a row."""
    deadline, asleep = time.monotonic() + 30, 0
    while asleep < polls:
        state = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        asleep = asleep + 1 if state == "S" else 0
        if time.monotonic() > deadline:
            raise AssertionError(f"the main thread of {pid} never blocked (state {state})")
        time.sleep(0.02)


def _run_blocked(
    work: Path, mode: str
) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], float]:
    peer = _spawn("blocked", "1", mode, work=work, stdin=subprocess.PIPE)
    main = _spawn("blocked", "0", mode, work=work)
    _wait_for(work / "ready-0", 60, [main, peer])
    _wait_blocked(main.pid)  # inside the allreduce's C++ wait, where Python handlers cannot run
    main.send_signal(signal.SIGTERM)
    return main, peer, time.monotonic()


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_sigterm_during_a_blocked_collective_triggers_the_save(tmp_path: Path) -> None:
    main, peer, signalled = _run_blocked(tmp_path, "wakeup")
    try:
        code = main.wait(20)
        took = time.monotonic() - signalled
    finally:
        _stop(main, peer)
    log = (tmp_path / "log-blocked-0.txt").read_text()
    assert code == 128 + signal.SIGTERM, log
    assert not (tmp_path / "returned").exists(), (
        "the allreduce never returned: the main thread stayed blocked"
    )
    info = ckpt.verify(tmp_path / "ckpt", 3)
    state = torch.load(info.path, weights_only=True)
    assert (
        info.manifest.jit
        and state["step"] == 3
        and torch.equal(state["model"]["w"], torch.full((3,), 3.0))
    )
    assert state["python_handler_ran"] is False, (
        "saved while the Python-level handler could not run"
    )
    assert 1.0 <= took < 8.0, (
        f"saved and exited {took:.1f} s after SIGTERM (stall detection is 1 s)"
    )


def test_without_the_wakeup_a_flag_only_handler_never_runs_while_blocked(tmp_path: Path) -> None:
    main, peer, _ = _run_blocked(tmp_path, "flag-only")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            main.wait(3)
    finally:
        _stop(main, peer)
    assert not (tmp_path / "ckpt").exists() or ckpt.iter_checkpoints(tmp_path / "ckpt") == []
    assert "received SIGTERM" not in (tmp_path / "log-blocked-0.txt").read_text()


def test_a_save_while_the_main_thread_is_blocked_in_a_collective_is_immediate(
    tmp_path: Path,
) -> None:
    peer = _spawn("blocked", "1", "direct", work=tmp_path, stdin=subprocess.PIPE)
    main = _spawn("blocked", "0", "direct", work=tmp_path)
    try:
        code = main.wait(60)
    finally:
        _stop(main, peer)
    assert code == 0, (tmp_path / "log-blocked-0.txt").read_text()
    result = json.loads((tmp_path / "direct.json").read_text())
    assert not (tmp_path / "returned").exists(), "the allreduce was still blocked"
    assert result["saved"] and result["step"] == 3
    assert result["took"] < 1.0, (
        f"the save took {result['took']:.2f} s: it must not wait for the collective"
    )


def test_every_rank_saves_rank0s_buffers_of_the_last_step(tmp_path: Path) -> None:
    (rank0, rank1), _ = _run_pair("buffers", work=tmp_path)
    # Round 1: rank 1's own statistics were different and the live ones -5.0 when it saved.
    expected = {
        "mean": [0.0, 0.0, 1.0],
        "negative_zero": [True, False, False],
        "count": 10,
        "half": [torch.tensor(1 / 3, dtype=torch.bfloat16).item()] * 2,
        "half_dtype": "torch.bfloat16",
        "big": 2**40 + 1,
        "source": "rank0",
    }
    assert rank0["round1"] == rank1["round1"] == expected
    # Round 2: rank 0's copy never arrived, so rank 1 never updated: it saves round 1's buffers.
    assert rank1["round2"] == expected
    # Round 0 (the start, before any exchange): rank 1 holds what rank 0 holds, as rank 0's. Rank 0
    # would read "rank0" whatever the identical-start commit did; rank 1 shows that it worked.
    start = {
        "mean": [0.5] * 3,
        "negative_zero": [False] * 3,
        "count": 0,
        "half": [0.0] * 2,
        "half_dtype": "torch.bfloat16",
        "big": 0,
        "source": "rank0",
    }
    assert rank1["round0"] == start and rank0["round0"] == start


@pytest.mark.parametrize("jit", ["on", "off", "off-unsynced"])
def test_a_stop_signal_ends_the_run_after_the_step_in_progress(tmp_path: Path, jit: str) -> None:
    """On the CPU the step's control rides on a gradient that DDP reduces in the backward
    (``runtime/grad_carrier.py``, the default), which the update waits for: the stop flag of step
    SIGNAL_STEP is read in that step. Rank 0's buffers ride along with JIT on, or off with DDP's
    buffer broadcast wanted (which they then replace), not with ``broadcast_buffers=False``. (With
    the control on its own collective, ``ELASTIC_TRAINER_CONTROL_CARRIER=0``, overlapping the next
    step, the unsynchronised run stops one step later.)"""
    stopped_after = SIGNAL_STEP
    results, logs = _run_pair("stop", jit, work=tmp_path)
    expected = {"step": stopped_after, "signal": True, "exchanged": jit != "off-unsynced"}
    assert results == [expected, expected], logs
    # The newest is the step the run stopped after (a JIT save of an earlier step may precede it
    # when a loaded machine stalls a rank past the stall limit after the signal).
    assert ckpt.iter_checkpoints(tmp_path / "ckpt")[-1] == stopped_after
    assert f"stopping after step {stopped_after} (signal on another rank)" in logs[0]


if __name__ == "__main__":
    _main(sys.argv[1:])
