"""Nodes for the test tiers: torchrun agents as real processes, and the faults injected into them.

An :class:`Agent` is :class:`elastic_trainer.ops.processes.NodeProcess` (a ``torchrun`` agent or
an ``elastic-trainer run`` launcher, with its log file): ``kill_worker`` (SIGKILL one worker),
``kill_node`` (a lost node: the agent frozen, every worker's process group and the agent
SIGKILLed), ``terminate`` (SIGTERM, as a preempted or scaled-down node gets), ``stop`` (clean-up).
:func:`start_agent` starts one on the real ``etcd-v3`` rendezvous running the ``synthetic_cnn``
example; :func:`agents` stops every agent of a test, pass or fail::

    with agents() as started:
        started.append(agent := start_agent(endpoint=..., run_id=..., log_path=..., job_args=[...]))
        wait_for(lambda: steps_recorded(samples) >= 7, timeout=120, what="step 7",
                 describe=lambda: tails(started))
        agent.kill_worker()
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from elastic_trainer.ops.processes import NodeProcess, start_process
from elastic_trainer.runtime.sample_log import generations

Agent = NodeProcess
"""One node of a test: a ``torchrun`` agent or an ``elastic-trainer run`` launcher."""

# Fast elastic rounds: the 30 s last-call default would dominate every test.
FAST_RDZV_CONF = "last_call_timeout=1,join_timeout=120,retry_timeout=10"
EXAMPLE = "elastic_trainer.examples.synthetic_cnn"


def start_torchrun(
    torchrun_args: Sequence[str],
    target: Sequence[str],
    log_path: Path,
    extra_env: dict[str, str] | None = None,
) -> Agent:
    """Start ``python -m torch.distributed.run TORCHRUN_ARGS TARGET``, its output appended to
    ``log_path``, in this environment plus ``extra_env`` (``ELASTIC_TRAINER_METRICS`` of the
    caller's shell left out: a test that wants metrics asks for them)."""
    env = {**os.environ, **(extra_env or {})}
    if "ELASTIC_TRAINER_METRICS" not in (extra_env or {}):
        env.pop("ELASTIC_TRAINER_METRICS", None)
    return start_process(
        [sys.executable, "-m", "torch.distributed.run", *torchrun_args, *target], log_path, env
    )


def start_agent(
    *,
    endpoint: str,
    run_id: str,
    log_path: Path,
    job_args: Sequence[str],
    nnodes: str = "1",
    nproc_per_node: int = 2,
    max_restarts: int = 3,
    rdzv_conf: str = FAST_RDZV_CONF,
    extra_env: dict[str, str] | None = None,
    target: Sequence[str] | None = None,
) -> Agent:
    """Start ``torchrun --rdzv-backend=etcd-v3 ... -m synthetic_cnn JOB_ARGS`` (or ``TARGET JOB_ARGS``)."""
    torchrun_args = [
        "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf={rdzv_conf}", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
    ]  # fmt: skip
    job = [*(target if target is not None else ["-m", EXAMPLE]), *job_args]
    return start_torchrun(torchrun_args, job, log_path, {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                                                         **(extra_env or {})})  # fmt: skip


@contextlib.contextmanager
def agents() -> Iterator[list[Agent]]:
    """A list to append agents to; every one is stopped at exit, even when the test fails."""
    started: list[Agent] = []
    try:
        yield started
    finally:
        with contextlib.ExitStack() as stopping:  # every agent is stopped even if one stop fails
            for agent in started:
                stopping.callback(agent.stop)


def tails(agents: Sequence[Agent], lines: int = 40) -> str:
    """The last ``lines`` lines of each agent's log, headed by its log's name and pid."""
    return "\n\n".join(
        f"--- node {a.log_path.name} (pid {a.pid}) ---\n{a.tail(lines)}" for a in agents
    )


def kill_rank(agent: Agent, samples: Path, rank: int) -> int:
    """SIGKILL the worker of ``rank`` in the newest generation (it must be ``agent``'s); its pid."""
    newest = generations(samples)[-1]
    pid = newest.pids[rank]
    if pid not in agent.worker_pids():
        raise AssertionError(
            f"rank {rank} (pid {pid}) is not a worker of agent {agent.pid}: {agent.worker_pids()}"
        )
    os.kill(pid, signal.SIGKILL)
    return pid
