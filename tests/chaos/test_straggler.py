"""A straggler: one rank is 3x slower (and more) for a while.

Node b's rank sleeps inside its forward pass for its first steps (``CHAOS_SLOW_MS``, see
:mod:`tests.chaos.chaos_job`). Synchronous DDP makes everyone wait for it, but nothing may time
out: the job goes on, the group never restarts, the weights are bitwise the no-fault run's, and
the straggler metric -- ``elastic_trainer_step_compute_seconds``, step time minus the time spent
waiting for peers, scraped from each node launcher's metrics endpoint -- singles out the slow rank.
"""

from __future__ import annotations

import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rendezvous.etcd_server import free_port
from tests.chaos.faults import (
    FaultInjector,
    JobSpec,
    RunDirs,
    start_node,
    unique_run_id,
    wait_all,
)
from tests.chaos.invariants import check_run, describe
from tests.support.agents import Agent, agents, tails

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

JOB = JobSpec(throttle_ms=20)
SLOW_MS, SLOW_STEPS = 150, 45  # a step computes in ~10-30 ms here: 150 ms more is > 3x slower
STRAGGLER_METRIC = "elastic_trainer_step_compute_seconds"


def mean_compute_by_rank(port: int) -> dict[int, float]:
    """Mean of the straggler metric per rank, from one node's metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    sums: dict[int, float] = {}
    counts: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != STRAGGLER_METRIC:
            continue
        for sample in family.samples:
            rank = int(sample.labels["rank"])
            if sample.name == STRAGGLER_METRIC + "_sum":
                sums[rank] = sample.value
            elif sample.name == STRAGGLER_METRIC + "_count":
                counts[rank] = sample.value
    return {rank: sums[rank] / counts[rank] for rank in sums if counts.get(rank)}


def rank_of(node: Agent) -> int:
    """The rank of the node's one worker, from its log."""
    match = re.search(r"\[rank (\d+)\] INFO elastic_trainer.runtime.distributed", node.output())
    assert match, node.tail()
    return int(match.group(1))


def test_straggler_keeps_training_and_shows_in_the_metric(
    etcd_server, no_fault, run_dirs: RunDirs
) -> None:
    run_id = unique_run_id("straggler")
    ports = {"a": free_port(), "b": free_port()}
    scraped: dict[int, float] = {}
    with agents() as nodes:
        for name in ("a", "b"):
            env = (
                {"CHAOS_SLOW_MS": str(SLOW_MS), "CHAOS_SLOW_STEPS": str(SLOW_STEPS)}
                if name == "b"
                else {}
            )
            nodes.append(
                start_node(
                    name=name,
                    run=run_dirs,
                    job=JOB,
                    endpoint=etcd_server.endpoint,
                    run_id=run_id,
                    nnodes="2",
                    metrics_port=ports[name],
                    env=env,
                )
            )
        node_a = nodes[0]

        def scrape() -> None:
            for port in ports.values():
                scraped.update(mean_compute_by_rank(port))

        faults = FaultInjector(run_dirs).at_step(
            SLOW_STEPS - 10, "scrape both nodes' metrics", scrape
        )
        faults.run_until(lambda: node_a.proc.poll() is not None, timeout=150, agents=nodes)
        codes = wait_all(nodes, timeout=30)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(nodes)}"
        slow_rank = rank_of(nodes[1])

    print(f"mean step compute by rank while node b was slow: {scraped}")
    assert len(scraped) == 2, f"the metric for both ranks: {scraped}"
    slow = max(scraped, key=scraped.__getitem__)
    fast = 1 - slow
    assert slow == slow_rank, (
        f"the metric points at rank {slow}, but node b's rank {slow_rank} was slow"
    )
    assert scraped[slow] >= 3 * scraped[fast], (
        f"the straggler metric does not single out rank {slow}: {scraped}"
    )
    assert scraped[slow] >= SLOW_MS / 1000 * 0.9

    summary = check_run(run_dirs, JOB, no_fault, reference_world=2)
    print(describe(summary))
    assert len(summary.generations) == 1, "a timeout fired: the group restarted"
