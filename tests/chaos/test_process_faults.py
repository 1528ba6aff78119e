"""Process faults on a two-node job: a worker SIGKILLed, a node SIGKILLed, a node SIGTERMed
(Kubernetes scale-down), a node joining (scale-up).

Each node is its own ``elastic-trainer run`` launcher process with one worker, all on one real
etcd. After each fault the job must finish with every sample consumed exactly once per epoch, no
checkpoint lost, and the no-fault run's weights (bitwise when the world size never changed; see
:mod:`tests.chaos.invariants` for the tolerance otherwise).
"""

from __future__ import annotations

import pytest

from tests.chaos.faults import FaultInjector, JobSpec, RunDirs, start_node, tails, unique_run_id, wait_all
from tests.chaos.invariants import check_run, describe
from tests.runtime_helpers import agents

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

JOB = JobSpec()


def test_worker_sigkill(etcd_server, reference_runs, run_dirs: RunDirs) -> None:
    reference = reference_runs(JOB, 2)
    run_id = unique_run_id("worker-kill")
    with agents() as nodes:
        for name in ("a", "b"):
            nodes.append(start_node(name=name, run=run_dirs, job=JOB, endpoint=etcd_server.endpoint,
                                    run_id=run_id, nnodes="2"))
        node_a, node_b = nodes
        faults = FaultInjector(run_dirs).at_step(10, "worker SIGKILL on node b", lambda: node_b.kill_worker())
        faults.run_until(lambda: node_a.proc.poll() is not None, timeout=150, agents=nodes)
        codes = wait_all(nodes, timeout=30)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(nodes)}"

    summary = check_run(run_dirs, JOB, reference, reference_world=2)
    print(describe(summary))
    assert len(summary.generations) == 2, "the worker group restarted exactly once"
