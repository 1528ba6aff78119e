"""The FSDP row of the chaos suite: a sharded (FSDP2) job of two nodes, one worker each, each its
own ``elastic-trainer run --heal off`` launcher (the restart path) training ``sharded_lm`` through
the ``Trainer``; node b's worker is SIGKILLed mid-run. The group restarts from the newest sharded
checkpoint, every rank reading its own shards: the just-in-time one of the last completed step,
node b's shards written from their neighbour copy on node a (at most one step redone), and the
job ends bitwise equal (model and AdamW
state) to a run without the fault beside it, every sample of every epoch trained exactly once,
every checkpoint left verifying, the restart resumed from the newest one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.chaos.faults import FaultInjector, JobSpec, RunDirs, start_node, unique_run_id, wait_all
from tests.chaos.invariants import check_checkpoints, check_exactly_once, generations, steps_lost
from tests.support.agents import agents, start_agent, tails
from tests.support.records import final_sharded_state

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

JOB = JobSpec(dataset_size=120, global_batch_size=12, epochs=2, checkpoint_every=4)
TARGET = ("-m", "elastic_trainer.examples.sharded_lm")


def _worker_args(job: JobSpec, run: RunDirs) -> list[str]:
    return [
        "--api",
        "trainer",
        "--dataset-size",
        str(job.dataset_size),
        "--global-batch-size",
        str(job.global_batch_size),
        "--epochs",
        str(job.epochs),
        "--max-steps",
        str(job.steps),
        "--seed",
        str(job.seed),
        "--checkpoint-dir",
        str(run.checkpoints),
        "--checkpoint-every",
        str(job.checkpoint_every),
        "--keep-last",
        str(job.keep_last),
        "--record-samples",
        str(run.samples),
        "--throttle-ms",
        "60",
        "--log-every",
        "4",
    ]


def test_fsdp_worker_sigkill_restarts_from_the_sharded_checkpoint(
    etcd_server, tmp_path: Path
) -> None:
    run, reference = RunDirs.under(tmp_path / "run"), RunDirs.under(tmp_path / "reference")
    run_id = unique_run_id("fsdp-kill")
    with agents() as nodes:
        nodes.append(
            start_agent(  # the same job without the fault, at the same world size
                endpoint=etcd_server.endpoint,
                run_id=f"{run_id}-ref",
                log_path=reference.log("ref"),
                nproc_per_node=2,
                max_restarts=0,
                target=TARGET,
                job_args=_worker_args(JOB, reference),
            )
        )
        for name in ("a", "b"):
            nodes.append(
                start_node(
                    name=name,
                    run=run,
                    job=JOB,
                    endpoint=etcd_server.endpoint,
                    run_id=run_id,
                    nnodes="2",
                    launch_options=("--heal", "off"),
                    worker=(*TARGET, *_worker_args(JOB, run)),
                )
            )
        _, node_a, node_b = nodes
        faults = FaultInjector(run).at_step(
            10, "worker SIGKILL on node b", lambda: node_b.kill_worker()
        )
        faults.run_until(lambda: node_a.proc.poll() is not None, timeout=180, agents=nodes)
        codes = wait_all(nodes, timeout=60)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(nodes)}"

    worlds = check_exactly_once(run, JOB)
    assert set(worlds) == {2}
    gens = generations(run.samples)
    assert len(gens) == 2, "the group restarted exactly once"
    check_checkpoints(run, JOB, gens)  # the restart resumed from the newest valid checkpoint
    print("generations", [(g.world_size, g.resumed_step) for g in gens])
    assert gens[1].resumed_step > 0 and steps_lost(run.samples) in ([0], [1])
    expected, got = final_sharded_state(reference.checkpoints), final_sharded_state(run.checkpoints)
    assert int(got["step"]) == JOB.steps and got.keys() == expected.keys()
    differing = [name for name in expected if not torch.equal(expected[name], got[name])]
    assert not differing, f"differ from the run without the fault: {differing}"
