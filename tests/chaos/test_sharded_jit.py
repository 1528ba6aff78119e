"""The just-in-time save of sharded state under plain ``torchrun --rdzv-backend=etcd-v3`` (the
restart path): ``sharded_lm`` (its own loop, FSDP2, the neighbour copy on by default) with 3
workers; rank 1 is SIGKILLed between two periodic checkpoints. The survivors write every shard
they hold, rank 1's from its neighbour copy on rank 0, as one sharded checkpoint of the last
completed step, and torchrun's restart resumes from it: at most one step redone (counted), not
everything since the periodic checkpoint. Then the launcher is SIGTERMed: every rank writes its
shards the same way (the SIGTERM checkpoint), and a new launcher resumes from it. The job ends
bitwise equal (model and AdamW state) to the same schedule without the faults beside it, every
sample of every epoch trained exactly once. One real run serves every assertion.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_trainer.ops.processes import wait_for
from elastic_trainer.runtime.sample_log import committed_history, generations, read_records
from tests.support.agents import agents, kill_rank, start_agent, tails
from tests.support.records import final_sharded_state, steps_recorded

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

TARGET = ["-m", "elastic_trainer.examples.sharded_lm"]
DATASET, BATCH, EPOCHS, STEPS = 120, 12, 3, 26  # 10 steps per epoch
EVERY = 8  # periodic checkpoints at 8, 16, 24
KILL_AFTER, SIGTERM_AFTER = 10, 18  # between periodic checkpoints


def _job(root: Path) -> list[str]:
    return [
        "--max-steps", str(STEPS), "--epochs", str(EPOCHS), "--dataset-size", str(DATASET),
        "--global-batch-size", str(BATCH), "--checkpoint-every", str(EVERY),
        "--checkpoint-dir", str(root / "ckpt"), "--seed", "3", "--record-samples",
        str(root / "samples"), "--log-every", "100", "--throttle-ms", "80",
    ]  # fmt: skip


def test_sigkill_and_sigterm_resume_from_the_just_in_time_sharded_checkpoint(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    faulty, samples = tmp_path / "faulty", tmp_path / "faulty" / "samples"
    with agents() as started:
        reference = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=f"{unique_id}-ref",
            log_path=tmp_path / "reference.log",
            nproc_per_node=3,
            max_restarts=0,
            target=TARGET,
            job_args=_job(tmp_path / "reference"),
        )
        started.append(reference)
        for segment in range(2):
            agent = start_agent(
                endpoint=etcd_server.endpoint,
                run_id=f"{unique_id}-{segment}",
                log_path=tmp_path / "faulty.log",
                nproc_per_node=3,
                max_restarts=1,
                target=TARGET,
                job_args=_job(faulty),
            )
            started.append(agent)
            after = KILL_AFTER if segment == 0 else SIGTERM_AFTER
            wait_for(
                lambda after=after: steps_recorded(samples) >= after,
                timeout=150,
                what=f"step {after}",
                describe=lambda: tails(started),
            )
            if segment == 0:
                print(f"SIGKILLed rank 1 (pid {kill_rank(agent, samples, 1)})")
                # torchrun restarts the group; it goes on to the SIGTERM below.
                wait_for(
                    lambda: (
                        len(generations(samples)) >= 2 and steps_recorded(samples) >= SIGTERM_AFTER
                    ),
                    timeout=150,
                    what=f"the restart and step {SIGTERM_AFTER}",
                    describe=lambda: tails(started),
                )
            agent.terminate()  # torchrun passes SIGTERM on to its workers
            assert agent.wait(90) != 0, agent.tail()
            print("SIGTERMed the launcher")
        last = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=f"{unique_id}-2",
            log_path=tmp_path / "faulty.log",
            nproc_per_node=3,
            max_restarts=0,
            target=TARGET,
            job_args=_job(faulty),
        )
        started.append(last)
        assert last.wait(150) == 0, last.tail()
        assert reference.wait(150) == 0, reference.tail()
    log = (tmp_path / "faulty.log").read_text()

    gens = generations(samples)
    assert [g.world_size for g in gens] == [3, 3, 3], "the SIGKILL's restart, then the new launcher"
    redone = [gens[i].last_step - gens[i + 1].resumed_step for i in (0, 1)]
    print("steps redone after the SIGKILL and after the SIGTERM:", redone)
    assert gens[1].resumed_step > EVERY and gens[1].resumed_step % EVERY, (
        "the SIGKILL's restart resumed from the just-in-time checkpoint, not a periodic one"
    )
    assert all(0 <= n <= 1 for n in redone), f"steps redone {redone}"
    assert log.count("(a just-in-time checkpoint)") >= 2, log[-4000:]
    assert "the neighbour copy" in log, "rank 1's shards came from the copy on rank 0"

    expected, got = (
        final_sharded_state(tmp_path / "reference" / "ckpt"),
        final_sharded_state(faulty / "ckpt"),
    )
    assert int(got["step"]) == int(expected["step"]) == STEPS
    assert got.keys() == expected.keys()
    differing = [name for name in expected if not torch.equal(expected[name], got[name])]
    assert not differing, f"differ from the run without the faults: {differing}"
    history = committed_history(read_records(samples))
    assert sorted(history) == list(range(1, STEPS + 1))
    by_epoch: dict[int, list[int]] = {}
    for records in history.values():
        for record in records:
            by_epoch.setdefault(record["epoch"], []).extend(record["indices"])
    for epoch in range(STEPS * BATCH // DATASET):
        assert sorted(by_epoch[epoch]) == list(range(DATASET)), f"epoch {epoch}: not exactly once"
