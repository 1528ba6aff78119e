"""A node lost for good reshards FSDP2 (and HSDP) state in place, under ``elastic-trainer run``.

Two launchers of 2 workers each (``--nnodes 1:2``) train ``sharded_lm``; the node holding rank 0
is SIGKILLed between two steps. The other node's workers keep their processes, are renumbered
0 and 1, and heal at 2 ranks from what they hold: their own shards and, through the ring of
stride 2, the lost node's neighbour copies, cut into the shards of 2 ranks in memory
(``heal/shard_move.py``): 0 steps redone, no checkpoint read. The run ends bitwise equal (model
and AdamW state) to a reference with the same world-size history that changes size through a
checkpoint: 4 workers to the heal's step, then 2 workers from that checkpoint (DCP's resharded
load), and every sample of every epoch is trained exactly once. The same with HSDP 2 x 2
(``--replicas 2``): the lost node is replica 0, the survivors (replica 1) hold every shard, cut
into a 2 x 1 mesh. Design: ``docs/design/sharded.md``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from elastic_trainer.ops.processes import start_process, wait_for
from elastic_trainer.runtime.sample_log import generations
from tests.chaos.faults import FAST_LAUNCH_OPTIONS, FAST_RDZV_CONF
from tests.chaos.test_sharded_heal import (
    BATCH,
    DATASET,
    STEPS,
    _check_exact,
    _heal_times,
    _wait_between_steps,
)
from tests.support.agents import Agent, agents, tails

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
KILL_AFTER = 8


def _launch(
    endpoint: str,
    run_id: str,
    run: Path,
    node: str,
    *,
    nnodes: str,
    workers: int,
    steps: int = STEPS,
    extra: Sequence[str] = (),
    launch: Sequence[str] = (),
) -> Agent:
    run.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "elastic_trainer.cli", "run", "--rdzv-endpoint", endpoint,
        "--run-id", run_id, "--nnodes", nnodes, "--nproc-per-node", str(workers), "--device",
        "cpu", "--metrics-port", "0", "--rdzv-conf", FAST_RDZV_CONF, *FAST_LAUNCH_OPTIONS, *launch,
        "-m", "elastic_trainer.examples.sharded_lm", "--max-steps", str(steps), "--epochs", "5",
        "--dataset-size", str(DATASET), "--global-batch-size", str(BATCH),
        "--checkpoint-dir", str(run / "ckpt"), "--seed", "5", "--record-samples",
        str(run / "samples"), "--log-every", "100", "--throttle-ms", "250", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return start_process(cmd, run / f"node-{node}.log", env, cwd=REPO)


@pytest.mark.parametrize("replicas", [1, 2], ids=["fsdp", "hsdp"])
def test_a_lost_node_reshards_in_place_bitwise_equal_to_a_resharded_checkpoint(
    etcd_server, unique_id: str, tmp_path: Path, replicas: int
) -> None:
    faulty, reference = tmp_path / "faulty", tmp_path / "reference"
    endpoint = etcd_server.endpoint
    mesh = ("--replicas", str(replicas))
    with agents() as started:
        for node in ("a", "b"):
            # The first round waits for both nodes (it closes once both joined): on a busy
            # machine node b's launcher can start more than the 1 s last call after node a's
            # join, and a job that began at 2 ranks is not the 4 -> 2 reshard this test is about.
            started.append(
                _launch(endpoint, f"{unique_id}-f", faulty, node, nnodes="1:2", workers=2,
                        extra=("--checkpoint-every", "5", *mesh),
                        launch=("--last-call-timeout", "60"))
            )  # fmt: skip
        # The reference's first phase: 4 workers up to the step the heal will go on from (a
        # checkpoint every step: a kill that cuts the step's copy goes on from the one before).
        started.append(
            first := _launch(endpoint, f"{unique_id}-r1", reference, "4", nnodes="1", workers=4,
                             steps=KILL_AFTER, extra=("--checkpoint-every", "1", "--keep-last", "3",
                                                      *mesh))
        )  # fmt: skip
        _wait_between_steps(faulty, KILL_AFTER, 4, started)
        rank0 = generations(faulty / "samples")[-1].pids[0]
        victim = next(a for a in started[:2] if rank0 in a.worker_pids())
        survivor = started[1] if victim is started[0] else started[0]
        victim.kill_node()
        wait_for(
            lambda: len(generations(faulty / "samples")) == 2,
            timeout=60,
            what="the heal",
            describe=lambda: tails(started),
        )
        resumed = generations(faulty / "samples")[1].resumed_step
        assert first.wait(120) == 0, tails(started)
        # The second phase: 2 workers from the checkpoint of the step the heal went on from.
        for newer in (reference / "ckpt").glob(f"ckpt-{KILL_AFTER:012d}.*"):
            if resumed < KILL_AFTER:
                shutil.rmtree(newer) if newer.is_dir() else newer.unlink()
        started.append(
            second := _launch(endpoint, f"{unique_id}-r2", reference, "2", nnodes="1", workers=2,
                              extra=("--checkpoint-every", "5", *mesh))
        )  # fmt: skip
        assert survivor.wait(200) == 0, tails(started)
        assert second.wait(200) == 0, tails(started)
    log = survivor.output()
    print(f"node lost after step {KILL_AFTER}; epoch formed in {_heal_times(log)} s")

    gens = generations(faulty / "samples")
    assert len(gens) == 2, [(g.resumed_step, g.pids) for g in gens]
    assert sorted(gens[1].pids.values()) == sorted(
        pid for rank, pid in gens[0].pids.items() if rank in (2, 3)
    ), "the survivors kept their processes"
    # KILL_AFTER - 1: the kill cut the exchange of the step's copy (a loaded machine), and the
    # survivors went back to their staged copies of the step before, counted as 1 redone
    assert resumed in (KILL_AFTER - 1, KILL_AFTER), [(g.resumed_step, g.pids) for g in gens]
    healed = (
        rf"heal: shards of step {resumed} resharded in place from 4 to 2 ranks \(old rank 0's "
        rf"from rank \d's neighbour copy; [^\n]*\): {KILL_AFTER - resumed} step\(s\) redone"
        if replicas == 1  # HSDP: node b's ranks are replica 1, which holds every shard
        else rf"heal: shards of step {resumed} resharded in place from 4 to 2 ranks \(HSDP: 2 x 2 "
        rf"-> 2 x 1\) \(old shard 0's from rank \d's [^\n]*\): {KILL_AFTER - resumed} step\(s\) "
        "redone"
    )
    assert re.search(healed, log), log[-4000:]
    assert "every rank resumed from the newest checkpoint" not in log
    _check_exact(reference, faulty)
