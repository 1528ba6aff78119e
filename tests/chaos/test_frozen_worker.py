"""A frozen worker: node b's rank is SIGSTOPped mid-run (alive, but making no progress).

Without a watchdog its peer waits in the step's allreduce until the 30-minute collective timeout,
while torchrun and the metrics see healthy processes. With it (``--frozen-timeout 10``, the
default), node b's launcher names the worker in one line once its heartbeat has been still for the
threshold, counts it in ``elastic_trainer_frozen_workers_total`` on its ``/metrics``, and SIGKILLs
it; the job heals as after a worker SIGKILL, and every invariant of :mod:`tests.chaos.invariants`
holds (the world size never changes, so the final weights are bitwise the no-fault run's).
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
    freeze_workers,
    start_node,
    unique_run_id,
    wait_all,
)
from tests.chaos.invariants import check_run, describe
from tests.support.agents import agents, tails

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

JOB = JobSpec()
FROZEN_TIMEOUT_S = 10
"""``--frozen-timeout``: the floor of the threshold (the chaos job's steps take ~50 ms, so 5x the
median step is far below it: the threshold is the floor)."""
SLACK_S = 15.0
"""Allowed lateness of the report on this loaded machine: a correctness bound, not a benchmark."""
EARLY_S = 1.5
"""How much earlier than the floor a report may come: the last beat precedes the SIGSTOP by up
to one beat interval (0.5 s), and the watchdog polls every 0.5 s."""
FREEZE_AT_STEP = 22
"""Between two checkpoints (every 5 steps): the scenario is about the watchdog, so the frozen
worker (rank 0 or 1, whichever node b got) is not caught writing one."""
FROZEN_METRIC = "elastic_trainer_frozen_workers_total"
FROZEN_LINE = re.compile(
    r"worker rank (\d+) \(pid (\d+)\) on node (\S+) made no progress for ([\d.]+) s "
    r"\(frozen\); stopping it so the job heals"
)


def frozen_workers_total(port: int) -> dict[str, float]:
    """``node`` label -> value of the frozen-worker counter on one launcher's ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels["node"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == FROZEN_METRIC
    }


def rank_of_pid(run: RunDirs, pid: int) -> int:
    """The rank a worker process trained as, from its sample records' file name."""
    names = [p.name for p in run.samples.glob(f"samples-rank*-pid{pid}*.jsonl")]
    ranks = {
        int(m.group(1)) for name in names if (m := re.match(rf"samples-rank(\d+)-pid{pid}\b", name))
    }
    assert len(ranks) == 1, f"sample records of pid {pid}: {names}"
    return ranks.pop()


def test_frozen_worker_is_named_counted_stopped_and_the_job_heals(
    etcd_server, no_fault, run_dirs: RunDirs
) -> None:
    run_id = unique_run_id("frozen")
    ports = {"a": free_port(), "b": free_port()}
    frozen: list[int] = []
    scraped: dict[str, dict[str, float]] = {}
    with agents() as nodes:
        for name in ("a", "b"):
            nodes.append(
                start_node(
                    name=name,
                    run=run_dirs,
                    job=JOB,
                    endpoint=etcd_server.endpoint,
                    run_id=run_id,
                    nnodes="2",
                    metrics_port=ports[name],
                    env={"ELASTIC_TRAINER_FROZEN_TIMEOUT": str(FROZEN_TIMEOUT_S)},
                )
            )
        node_a, node_b = nodes

        def freeze() -> None:
            frozen.extend(freeze_workers([node_b]))
            assert len(frozen) == 1, (
                f"node b should have one worker to freeze, froze {frozen}\n{tails(nodes)}"
            )

        def scrape() -> None:
            scraped.update({name: frozen_workers_total(port) for name, port in ports.items()})

        faults = (
            FaultInjector(run_dirs)
            .at_step(FREEZE_AT_STEP, "SIGSTOP node b's worker", freeze)
            .when(
                lambda _step: FROZEN_LINE.search(node_b.output()) is not None,
                "node b reports its frozen worker",
                scrape,
            )
        )
        stop, report = faults.run_until(
            lambda: node_a.proc.poll() is not None, timeout=180, agents=nodes
        )
        codes = wait_all(nodes, timeout=30)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(nodes)}"
        logs = {"a": node_a.output(), "b": node_b.output()}

    assert stop.fired_at is not None and report.fired_at is not None
    detected_s = report.fired_at - stop.fired_at
    lines = {name: FROZEN_LINE.findall(log) for name, log in logs.items()}
    print(
        f"frozen worker reported {detected_s:.1f} s after its SIGSTOP: {lines['b']}; metrics {scraped}"
    )
    assert lines["a"] == [] and len(lines["b"]) == 1, f"one line, from node b only: {lines}"
    rank, pid, node, silent_s = lines["b"][0]
    assert int(pid) == frozen[0] and int(rank) == rank_of_pid(run_dirs, frozen[0]), lines["b"]
    assert float(silent_s) >= FROZEN_TIMEOUT_S  # printed to 0.1 s: 10.04 reads 10.0
    assert FROZEN_TIMEOUT_S - EARLY_S <= detected_s <= FROZEN_TIMEOUT_S + SLACK_S, (
        f"reported {detected_s:.1f} s after the SIGSTOP; threshold {FROZEN_TIMEOUT_S} s"
    )
    assert scraped["b"] == {node: 1.0}, f"node b's counter: {scraped}"
    assert list(scraped["a"].values()) == [0.0], f"node a stopped nothing: {scraped}"

    summary = check_run(run_dirs, JOB, no_fault, reference_world=2)
    print(describe(summary))
    assert len(summary.generations) >= 2, "the group healed after the frozen worker was stopped"
