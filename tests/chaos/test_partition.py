"""A node partitioned from the others and from etcd, then healed.

Each node runs in its own network namespace (:mod:`benchmarks.netns`), etcd in a third. Node b's
link goes silent mid-training: no connection is reset and no collective fails. Node a's launcher
misses node b's heartbeats (``launch/peer_heartbeat.py``) and opens a heal round before b's
liveness lease expires; node a's workers abort their group and train alone. Node b's workers,
blocked in a collective, time out (``ELASTIC_TRAINER_PG_TIMEOUT_S``, short here) and cannot heal
without etcd. The partition heals; node b rejoins and the job completes: every sample exactly once
per epoch, no checkpoint lost, the weights of a no-fault run through the same world sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_trainer.runtime.sample_log import generations
from tests.chaos.chaos_job import SLOW_MS_ENV, SLOW_WHILE_FILE_ENV
from tests.chaos.faults import (
    FaultInjector,
    JobSpec,
    RunDirs,
    start_node,
    unique_run_id,
    wait_all,
)
from tests.chaos.invariants import check_run, describe, phases_from_full_world
from tests.chaos.netns import private_network
from tests.support.agents import agents, tails

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

JOB = JobSpec(throttle_ms=60)
COLLECTIVE_TIMEOUT_S = 8


@pytest.mark.parametrize("cut", ["the other node", "the writer's node"])
def test_node_partitioned_then_healed(
    cut: str, no_fault, tmp_path: Path, run_dirs: RunDirs
) -> None:
    """``the writer's node``: the node of rank 0, which writes the checkpoints; cut off, it must
    commit none that the others do not know about (the commit fence), and the other node's
    worker becomes rank 0."""
    names = ["a", "b"]
    # From the partition until the cut-off node trains again the steps are slow: on a loaded
    # machine its rejoin (a new lease, new workers) may take longer than the rest of the job.
    hold = run_dirs.root / "until-rejoined"
    held = {SLOW_WHILE_FILE_ENV: str(hold), SLOW_MS_ENV: "250"}
    with private_network(names) as net, agents() as nodes:
        endpoint = net.start_etcd(tmp_path / "etcd" / "data")
        run_id = unique_run_id("partition")
        for name in names:
            nodes.append(
                start_node(
                    name=name,
                    run=run_dirs,
                    job=JOB,
                    endpoint=endpoint,
                    run_id=run_id,
                    nnodes="1:2",
                    netns=net.namespace(name),
                    local_addr=net.address(name),
                    env={
                        "GLOO_SOCKET_IFNAME": "eth0",
                        "ELASTIC_TRAINER_PG_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S),
                        **held,
                    },
                )
            )
        cut_off: list[int] = []

        def partition() -> None:
            rank0 = generations(run_dirs.samples)[-1].pids[0]
            writer = next(i for i, node in enumerate(nodes) if rank0 in node.worker_pids())
            cut_off.append(writer if cut == "the writer's node" else 1 - writer)
            hold.touch()
            net.partition(names[cut_off[0]])

        faults = (
            FaultInjector(run_dirs)
            .at_step(20, f"{cut} partitioned", partition)
            # Heal once the other node trains alone: the cut-off node's agent must rejoin
            # under a new lease, its workers as newcomers.
            .when(
                lambda step: run_dirs.steps(world_size=1) >= 30,
                "partition healed",
                lambda: net.heal(names[cut_off[0]]),
            )
            .when(
                lambda step: _trains_again(run_dirs),
                "the cut-off node trains again",
                lambda: hold.unlink(missing_ok=True),
            )
        )
        faults.run_until(
            lambda: all(n.proc.poll() is not None for n in nodes), timeout=240, agents=nodes
        )
        codes = wait_all(nodes, timeout=60)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(nodes)}"
        survivor_log = nodes[1 - cut_off[0]].output()

    summary = check_run(run_dirs, JOB, no_fault, reference_world=2)
    print(describe(summary))
    assert phases_from_full_world(summary.world_phases, 2) == [2, 1, 2], (
        "one node went on alone during the partition, then the other rejoined"
    )
    assert "is gone (no heartbeat for" in survivor_log, (
        "the partition was noticed by heartbeats, not a lease"
    )


def _trains_again(run_dirs: RunDirs) -> bool:
    """A generation of two after one of one has completed a step: the cut-off node is back."""
    gens = generations(run_dirs.samples)
    alone = next((i for i, g in enumerate(gens) if g.world_size == 1), None)
    return alone is not None and any(
        g.world_size == 2 and g.last_step > g.resumed_step for g in gens[alone + 1 :]
    )
