"""Just-in-time save under real torchrun + etcd-v3 (gloo, CPU): a worker SIGKILLed at a random
step costs at most one step although no periodic checkpoint exists, and the run still ends
bitwise equal to an uninterrupted one (rank 0 or rank 1 killed, also at the exact points of a
step where rank 0's BatchNorm statistics could go missing); a node's graceful SIGTERM loses
no step; with JIT off the same kill falls back to the periodic checkpoint (the test can fail); and
a SIGTERM that finds a worker blocked on a hung peer still saves, within seconds."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.ops.processes import wait_for
from elastic_trainer.runtime.sample_log import committed_history, generations, read_records
from tests.support.agents import agents, kill_rank, start_agent, tails
from tests.support.records import final_model, steps_recorded

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

KILL_AT_JOB = Path(__file__).parent / "scripts" / "kill_at_job.py"

DATASET, BATCH, EPOCHS = 600, 24, 2  # 25 steps per epoch, 50 in all
STEPS_PER_EPOCH = DATASET // BATCH
STEPS = EPOCHS * STEPS_PER_EPOCH


def _job(tmp: Path, name: str, *extra: str) -> list[str]:
    return [
        "--dataset-size",
        str(DATASET),
        "--global-batch-size",
        str(BATCH),
        "--epochs",
        str(EPOCHS),
        "--checkpoint-dir",
        str(tmp / name / "ckpt"),
        "--seed",
        "13",
        "--record-samples",
        str(tmp / name / "samples"),
        "--throttle-ms",
        "40",
        "--log-every",
        "5",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(etcd_server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Final weights of the uninterrupted run (same seed, same world size)."""
    tmp = tmp_path_factory.mktemp("jit-reference")
    with agents() as started:
        agent = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=f"jit-ref-{tmp.name}",
            max_restarts=0,
            log_path=tmp / "reference.log",
            job_args=_job(tmp, "ref", "--checkpoint-every", "1000"),
        )
        started.append(agent)
        assert agent.wait(180) == 0, agent.tail()
    step, model = final_model(tmp / "ref" / "ckpt")
    assert step == STEPS
    return model


def _assert_bitwise(model: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert model.keys() == expected.keys()
    for name in model:
        assert torch.equal(model[name], expected[name]), (
            f"{name} differs from the uninterrupted run"
        )


def _kill_and_finish(
    etcd_server,
    run_id: str,
    tmp: Path,
    *,
    rank: int,
    kill_after: int,
    every: str,
    env: dict[str, str] | None = None,
) -> tuple[str, list]:
    samples = tmp / "faulty" / "samples"
    with agents() as started:
        agent = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=run_id,
            max_restarts=2,
            log_path=tmp / "faulty.log",
            extra_env=env,
            job_args=_job(tmp, "faulty", "--checkpoint-every", every),
        )
        started.append(agent)
        wait_for(
            lambda: steps_recorded(samples) >= kill_after,
            timeout=120,
            what=f"step {kill_after}",
            describe=lambda: tails(started),
        )
        pid = kill_rank(agent, samples, rank)
        print(f"SIGKILLed rank {rank} (pid {pid}) once step {kill_after} was recorded")
        assert agent.wait(180) == 0, agent.tail()
    return agent.output(), generations(samples)


@pytest.mark.parametrize("rank", [0, 1])
def test_worker_sigkill_loses_at_most_one_step_and_stays_bitwise(
    etcd_server, unique_id: str, tmp_path: Path, reference: dict[str, torch.Tensor], rank: int
) -> None:
    kill_after = random.Random().randint(STEPS_PER_EPOCH + 2, STEPS - 5)  # mid epoch 1
    log, gens = _kill_and_finish(
        etcd_server, unique_id, tmp_path, rank=rank, kill_after=kill_after, every="1000"
    )

    assert len(gens) == 2, f"the group was restarted exactly once: {gens}"
    killed, resumed = gens
    print(f"last step before the kill {killed.last_step}, resumed from {resumed.resumed_step}")
    assert killed.last_step - resumed.resumed_step <= 1, "more than one step lost"
    assert resumed.resumed_step >= kill_after - 1
    info = ckpt.verify(tmp_path / "faulty" / "ckpt", resumed.resumed_step)
    assert info.manifest.jit, "resumed from a just-in-time checkpoint (no periodic one exists)"
    state = torch.load(info.path, weights_only=True)
    assert state["jit"]["writer_rank"] == 1 - rank, "the survivor wrote it"
    assert f"just-in-time checkpoint of step {resumed.resumed_step} written" in log
    assert "(a just-in-time checkpoint)" in log

    step, model = final_model(tmp_path / "faulty" / "ckpt")
    assert step == STEPS
    _assert_bitwise(model, reference)
    history = committed_history(read_records(tmp_path / "faulty" / "samples"))
    assert sorted(history) == list(range(1, STEPS + 1))
    for epoch in range(EPOCHS):
        indices = [
            i
            for recs in history.values()
            for r in recs
            if r["epoch"] == epoch
            for i in r["indices"]
        ]
        assert len(indices) == DATASET and sorted(indices) == list(range(DATASET)), f"epoch {epoch}"


@pytest.mark.parametrize(("point", "lost"), [("before_control", 1), ("after_update", 0)])
def test_rank0_killed_at_an_exact_point_of_a_step_still_resumes_bitwise(
    etcd_server,
    unique_id: str,
    tmp_path: Path,
    reference: dict[str, torch.Tensor],
    point: str,
    lost: int,
) -> None:
    """Deterministic: rank 0 SIGKILLs itself (test hook) right before the control allreduce of
    step 30, or right after its update of step 30 (the window in which the survivor used to hold
    step 30's weights without rank 0's BatchNorm statistics of step 30)."""
    kill_step = 30
    samples = tmp_path / "faulty" / "samples"
    with agents() as started:
        agent = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=unique_id,
            max_restarts=2,
            log_path=tmp_path / "faulty.log",
            target=[str(KILL_AT_JOB), f"0:{kill_step}:{point}"],
            job_args=_job(tmp_path, "faulty", "--checkpoint-every", "1000"),
        )
        started.append(agent)
        assert agent.wait(180) == 0, agent.tail()
    log = agent.output()
    assert f"test hook: SIGKILLing this worker at {point} of step {kill_step}" in log, agent.tail()
    gens = generations(samples)
    assert len(gens) == 2, f"the group was restarted exactly once: {gens}"
    killed, resumed = gens
    print(f"last step before the kill {killed.last_step}, resumed from {resumed.resumed_step}")
    assert resumed.resumed_step == kill_step - lost
    assert killed.last_step - resumed.resumed_step <= 1
    info = ckpt.verify(tmp_path / "faulty" / "ckpt", resumed.resumed_step)
    state = torch.load(info.path, weights_only=True)
    assert info.manifest.jit and state["jit"] == {"writer_rank": 1, "buffers": "rank0"}, state[
        "jit"
    ]
    step, model = final_model(tmp_path / "faulty" / "ckpt")
    assert step == STEPS
    _assert_bitwise(model, reference)


def test_dropout_model_resumes_bitwise_after_a_worker_sigkill(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    """Dropout draws random numbers in every step, and the killed rank's generator state dies with
    it: rank 0 is SIGKILLed, rank 1 saves just in time, and the resumed run still ends bitwise
    equal to an undisturbed run (every step reseeds from (seed, rank, step))."""
    dropout = ("--checkpoint-every", "1000", "--dropout", "0.3")
    kill_after = random.Random().randint(STEPS_PER_EPOCH + 2, STEPS - 5)
    samples = tmp_path / "faulty" / "samples"
    with agents() as started:
        undisturbed = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=f"{unique_id}-ref",
            max_restarts=0,
            log_path=tmp_path / "ref.log",
            job_args=_job(tmp_path, "ref", *dropout),
        )
        faulty = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=unique_id,
            max_restarts=2,
            log_path=tmp_path / "faulty.log",
            job_args=_job(tmp_path, "faulty", *dropout),
        )
        started += [undisturbed, faulty]
        wait_for(
            lambda: steps_recorded(samples) >= kill_after,
            timeout=120,
            what=f"step {kill_after}",
            describe=lambda: tails(started),
        )
        pid = kill_rank(faulty, samples, 0)
        print(f"SIGKILLed rank 0 (pid {pid}) once step {kill_after} was done")
        assert faulty.wait(180) == 0, faulty.tail()
        assert undisturbed.wait(180) == 0, undisturbed.tail()
    gens = generations(samples)
    assert len(gens) == 2, f"the group was restarted exactly once: {gens}"
    info = ckpt.verify(tmp_path / "faulty" / "ckpt", gens[1].resumed_step)
    assert info.manifest.jit, "resumed from rank 1's just-in-time checkpoint"
    assert "random streams derive from (seed, rank, step)" in faulty.output(), (
        "the guarantee is logged at resume"
    )
    step, model = final_model(tmp_path / "faulty" / "ckpt")
    ref_step, expected = final_model(tmp_path / "ref" / "ckpt")
    assert step == ref_step == STEPS
    _assert_bitwise(model, expected)


def test_without_jit_the_same_kill_falls_back_to_the_periodic_checkpoint(
    etcd_server, unique_id: str, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    kill_after = random.Random().randint(22, 26)  # after the checkpoint of step 20, well before 30
    log, gens = _kill_and_finish(
        etcd_server,
        unique_id,
        tmp_path,
        rank=1,
        kill_after=kill_after,
        every="10",
        env={"ELASTIC_TRAINER_JIT_SAVE": "0"},
    )
    assert len(gens) == 2
    killed, resumed = gens
    print(f"last step before the kill {killed.last_step}, resumed from {resumed.resumed_step}")
    assert resumed.resumed_step == 20, "the periodic checkpoint before the kill"
    assert killed.last_step - resumed.resumed_step > 1, (
        "steps were lost: the JIT test above can fail"
    )
    directory = tmp_path / "faulty" / "ckpt"
    assert not any(ckpt.verify(directory, s).manifest.jit for s in ckpt.iter_checkpoints(directory))
    assert "just-in-time checkpoint of" not in log
    _, model = final_model(tmp_path / "faulty" / "ckpt")
    _assert_bitwise(model, reference)


def test_node_sigterm_loses_no_step(etcd_server, unique_id: str, tmp_path: Path) -> None:
    samples = tmp_path / "elastic" / "samples"
    args = [
        "--dataset-size",
        str(DATASET),
        "--global-batch-size",
        str(BATCH),
        "--epochs",
        "4",
        "--seed",
        "13",
        "--checkpoint-dir",
        str(tmp_path / "elastic" / "ckpt"),
        "--checkpoint-every",
        "1000",
        "--record-samples",
        str(samples),
        "--throttle-ms",
        "60",
        "--log-every",
        "10",
    ]
    with agents() as started:
        node_a, node_b = (
            start_agent(
                endpoint=etcd_server.endpoint,
                run_id=unique_id,
                nnodes="1:2",
                nproc_per_node=1,
                max_restarts=3,
                log_path=tmp_path / f"node-{name}.log",
                job_args=args,
            )
            for name in ("a", "b")
        )
        started += [node_a, node_b]
        wait_for(
            lambda: steps_recorded(samples, world_size=2) >= 8,
            timeout=120,
            what="8 steps on 2 nodes",
            describe=lambda: tails(started),
        )
        node_b.terminate()  # graceful scale-down of one of the two nodes
        node_b.wait(60)
        assert node_a.wait(180) == 0, node_a.tail()
    assert "received SIGTERM" in node_b.output(), node_b.tail()
    gens = generations(samples)
    assert [g.world_size for g in gens] == [2, 1], gens
    before, after = gens
    print(f"last step on 2 nodes {before.last_step}, resumed on 1 node from {after.resumed_step}")
    assert after.resumed_step == before.last_step, "zero steps lost"
    step, _ = final_model(tmp_path / "elastic" / "ckpt")
    assert step == 4 * STEPS_PER_EPOCH


def test_sigterm_while_blocked_on_a_stuck_peer_saves_within_seconds(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    """Rank 1 hangs (SIGSTOP): rank 0 blocks in a collective that neither completes nor fails,
    where a Python signal handler cannot run. The node is then scaled down (SIGTERM to the agent,
    which SIGTERMs its workers and would SIGKILL them 30 s later): rank 0 saves its last completed
    step and exits within seconds."""
    samples = tmp_path / "stuck" / "samples"
    with agents() as started:
        agent = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=unique_id,
            max_restarts=0,
            log_path=tmp_path / "stuck.log",
            job_args=_job(tmp_path, "stuck", "--checkpoint-every", "1000", "--epochs", "20"),
        )
        started.append(agent)
        wait_for(
            lambda: steps_recorded(samples) >= 6,
            timeout=120,
            what="step 6",
            describe=lambda: tails(started),
        )
        pids = generations(samples)[-1].pids
        os.kill(pids[1], signal.SIGSTOP)
        # Rank 0 finishes at most the step in flight, then waits for rank 1 forever.
        wait_for(
            lambda: _stalled(samples, 0),
            timeout=30,
            what="rank 0 to stall",
            describe=lambda: tails(started),
        )
        signalled = time.monotonic()
        agent.terminate()
        wait_for(
            lambda: not _alive(pids[0]),
            timeout=25,
            what="rank 0 to exit",
            describe=lambda: tails(started),
        )
        took = time.monotonic() - signalled
        os.kill(pids[1], signal.SIGKILL)  # the hung worker; torchrun would do it after 30 s
        agent.wait(60)
    log = agent.output()
    last = max(g.last_step for g in generations(samples))
    print(f"rank 0 saved and exited {took:.1f} s after SIGTERM; last completed step {last}")
    assert took < 10, f"rank 0 took {took:.1f} s to exit"
    assert "SIGTERM received and no step boundary" in log, agent.tail()
    info = ckpt.verify(tmp_path / "stuck" / "ckpt", last)
    assert info.manifest.jit, "the last completed step was saved just in time"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


_progress: dict[str, tuple[int, float]] = {}


def _stalled(samples: Path, rank: int, quiet_s: float = 0.5) -> bool:
    """True once rank's recorded steps have not moved for ``quiet_s`` (steps take ~50 ms)."""
    step = max((g.last_step for g in generations(samples)), default=0)
    key = f"{samples}:{rank}"
    seen, since = _progress.get(key, (-1, time.monotonic()))
    if step != seen:
        _progress[key] = (step, time.monotonic())
        return False
    return time.monotonic() - since >= quiet_s
