"""etcd faults under a running two-node job: etcd restarted (a 5 s outage), and one member of a
3-member cluster lost.

Training does not need etcd between rendezvous rounds, so the job must go on through both; a
worker SIGKILL afterwards forces a new round on the recovered (or degraded) etcd, which must
complete too. The world size never changes, so the final weights must be bitwise the no-fault
run's.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rendezvous.etcd_server import local_cluster
from tests.chaos.faults import (
    FAST_RDZV_CONF,
    FaultInjector,
    JobSpec,
    RunDirs,
    in_background,
    start_nodes,
    unique_run_id,
    wait_all,
)
from tests.chaos.invariants import check_run, describe
from tests.support.agents import agents, tails
from tests.support.etcd_members import leader_first

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

# Slower steps: training must still be running when the outage ends.
JOB = JobSpec(throttle_ms=120)
# The default lease TTL (10 s) outlives the 5 s outage, as it should in production.
RDZV_CONF = FAST_RDZV_CONF.replace("lease_ttl=4", "lease_ttl=10")


def test_etcd_restart_5s_outage(own_etcd_server, no_fault, run_dirs: RunDirs) -> None:
    run_id = unique_run_id("etcd-restart")
    outage: list[threading.Thread] = []
    with agents() as nodes:
        start_nodes(
            nodes,
            ("a", "b"),
            run=run_dirs,
            job=JOB,
            endpoint=own_etcd_server.endpoint,
            run_id=run_id,
            nnodes="2",
            rdzv_conf=RDZV_CONF,
        )
        node_a, node_b = nodes
        restarted = in_background(lambda: own_etcd_server.restart(down_for=5.0), outage)
        faults = (
            FaultInjector(run_dirs)
            .at_step(12, "etcd down for 5 s", restarted)
            .when(lambda step: not outage[0].is_alive(), "etcd back", lambda: None)
            .when(
                lambda step: True, "worker SIGKILL after the outage", lambda: node_b.kill_worker()
            )
        )
        faults.run_until(lambda: node_a.proc.poll() is not None, timeout=150, agents=nodes)
        outage[0].join(30)
        codes = wait_all(nodes, timeout=30)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(nodes)}"
        down, back = (f.fired_at_step or 0 for f in faults.faults[:2])
    print(f"steps at: etcd down {down}, etcd back {back}")
    assert back > down, "the job trained on while etcd was down"

    summary = check_run(run_dirs, JOB, no_fault, reference_world=2)
    print(describe(summary))
    assert len(summary.generations) == 2, (
        "only the worker SIGKILL restarted the group, not the outage"
    )


def test_etcd_member_lost(tmp_path: Path, no_fault, run_dirs: RunDirs) -> None:
    """The leader of a 3-member cluster is SIGKILLed (and listed first, so the nodes' clients lose
    their current member); the cluster elects a new leader and the job rendezvous on two members."""
    with local_cluster(tmp_path / "etcd", 3) as servers, agents() as nodes:
        members = leader_first(servers)
        endpoint = ",".join(s.endpoint for s in members)
        run_id = unique_run_id("etcd-member")
        start_nodes(
            nodes,
            ("a", "b"),
            run=run_dirs,
            job=JOB,
            endpoint=endpoint,
            run_id=run_id,
            nnodes="2",
            rdzv_conf=RDZV_CONF,
        )
        node_a, node_b = nodes
        faults = (
            FaultInjector(run_dirs)
            .at_step(12, "etcd leader SIGKILLed", lambda: members[0].stop(kill=True))
            .at_step(
                24, "worker SIGKILL (a new round on two members)", lambda: node_a.kill_worker()
            )
        )
        faults.run_until(lambda: node_a.proc.poll() is not None, timeout=150, agents=nodes)
        codes = wait_all(nodes, timeout=30)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(nodes)}"
        assert not members[0].is_running()

    summary = check_run(run_dirs, JOB, no_fault, reference_world=2)
    print(describe(summary))
    assert len(summary.generations) == 2
