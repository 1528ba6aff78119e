"""A node partitioned from the others and from etcd, then healed.

Each node runs in its own network namespace (:mod:`tests.chaos.netns`), etcd in a third. Node b's
link goes silent mid-training: no connection is reset, so the survivors notice only when their
collective times out (``ELASTIC_TRAINER_PG_TIMEOUT_S``, short here) and node b's etcd lease
expires; node a then trains alone. The partition heals while node b's agent is trying to
rendezvous again, its lease long expired; node b rejoins under a new lease and the job completes: every sample exactly once per epoch, no checkpoint lost,
the weights of a no-fault run through the same world sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.faults import (
    FaultInjector,
    JobSpec,
    RunDirs,
    start_node,
    unique_run_id,
    wait_all,
)
from tests.chaos.invariants import check_run, describe
from tests.chaos.netns import private_network
from tests.support.agents import agents, tails

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

JOB = JobSpec(throttle_ms=60)
COLLECTIVE_TIMEOUT_S = 8


def test_node_partitioned_then_healed(no_fault, tmp_path: Path, run_dirs: RunDirs) -> None:
    with private_network(["a", "b"]) as net, agents() as nodes:
        endpoint = net.start_etcd(tmp_path / "etcd" / "data")
        run_id = unique_run_id("partition")
        for name in ("a", "b"):
            nodes.append(start_node(
                name=name, run=run_dirs, job=JOB, endpoint=endpoint, run_id=run_id, nnodes="1:2",
                netns=net.namespace(name), local_addr=net.address(name),
                env={"GLOO_SOCKET_IFNAME": "eth0", "ELASTIC_TRAINER_PG_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}))
        node_a, node_b = nodes
        faults = (FaultInjector(run_dirs)
                  .at_step(20, "node b partitioned", lambda: net.partition("b"))
                  # Heal once node a trains alone: node b's workers timed out with a's, so its agent
                  # is trying to rendezvous again, its lease long expired (it must rejoin under a new one).
                  .when(lambda step: run_dirs.steps(world_size=1) >= 30, "partition healed", lambda: net.heal("b")))
        faults.run_until(lambda: node_a.proc.poll() is not None, timeout=240, agents=nodes)
        codes = wait_all(nodes, timeout=60)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(nodes)}"

    summary = check_run(run_dirs, JOB, no_fault, reference_world=2)
    print(describe(summary))
    assert summary.world_phases == [2, 1, 2], "node a went on alone during the partition, then b rejoined"
