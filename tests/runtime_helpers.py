"""Helpers for runtime integration tests: torchrun agents on the real etcd-v3 rendezvous.

An :class:`Agent` is one ``python -m torch.distributed.run`` process (a "node") running the
``synthetic_cnn`` example; its output and its workers' go to a log file. Faults are small helpers:
:meth:`Agent.kill_worker` (SIGKILL one worker), :meth:`Agent.kill_node` (a lost node: stop the
agent, SIGKILL every worker's process group, SIGKILL the agent: torchrun starts workers in their
own sessions, so killing the agent alone would leave them running), :meth:`Agent.terminate`
(SIGTERM, as a preempted or scaled-down node gets).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastic_trainer.runtime.sample_log import generations, read_records

# Fast elastic rounds: torch's 30 s last call and heartbeat defaults would dominate every test.
FAST_RDZV_CONF = "last_call_timeout=1,join_timeout=120,heartbeat_timeout=6,keep_alive_interval=1,retry_timeout=10"
EXAMPLE = "elastic_trainer.examples.synthetic_cnn"


@dataclass
class Agent:
    """One torchrun agent process."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    _log_file: Any = field(repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def worker_pids(self) -> list[int]:
        """Current worker processes (warm-start clients resolved to their workers)."""
        from tests.agents import worker_processes

        return worker_processes(self.pid)

    def kill_worker(self, index: int = 0) -> int:
        """SIGKILL one worker; returns its pid."""
        pids = sorted(self.worker_pids())
        if not pids:
            raise AssertionError(f"agent {self.pid} has no workers to kill")
        pid = pids[index % len(pids)]
        os.kill(pid, signal.SIGKILL)
        return pid

    def terminate(self) -> None:
        """SIGTERM the agent (it forwards SIGTERM to its workers)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def kill_node(self) -> None:
        """The node vanishes: agent stopped, its workers' process groups and itself SIGKILLed."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGSTOP)
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(30)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {self.pid} still running after {timeout:.0f} s:\n{self.tail()}") from None

    def output(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def stop(self) -> None:
        """Cleanup for finalizers: nothing of this agent survives the test."""
        if self.proc.poll() is None:
            self.kill_node()
        else:
            for pid in self.worker_pids():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
        self._log_file.close()


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
    """Start ``torchrun --rdzv-backend=etcd-v3 ... -m synthetic_cnn JOB_ARGS``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(extra_env or {}))
    env.pop("ELASTIC_TRAINER_METRICS", None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf={rdzv_conf}", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
        *(target if target is not None else ["-m", EXAMPLE]), *job_args,
    ]
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed by Agent.stop
    log_file.write(("$ " + " ".join(cmd) + "\n").encode())
    log_file.flush()
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Agent(proc=proc, log_path=log_path, _log_file=log_file)


@contextlib.contextmanager
def agents() -> Iterator[list[Agent]]:
    """A list to append agents to; every one is stopped at exit, even when the test fails."""
    started: list[Agent] = []
    try:
        yield started
    finally:
        for agent in started:
            agent.stop()


def wait_for(condition: Callable[[], Any], *, timeout: float, what: str, agents: Sequence[Agent] = (),
             interval: float = 0.02) -> Any:
    """Poll ``condition`` until it returns something truthy; fail with the agents' logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    logs = "\n\n".join(f"--- agent {a.pid} ---\n{a.tail()}" for a in agents)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs}")


def world_of(records: list[dict[str, Any]]) -> int:
    """The world size of one process's records (from its ``start`` record)."""
    return int(records[0]["world_size"])


def steps_recorded(directory: Path, *, world_size: int | None = None) -> int:
    """The highest step any rank completed (optionally only in a world of ``world_size``)."""
    best = 0
    if not directory.exists():
        return 0
    for records in read_records(directory):
        for record in records:
            if record["event"] == "done" and (world_size is None or world_of(records) == world_size):
                best = max(best, record["step"])
    return best


def final_model(checkpoint_dir: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """Step and model state of the newest checkpoint, read as a user would."""
    newest = sorted(checkpoint_dir.glob("ckpt-*.pt"))[-1]
    state = torch.load(newest, weights_only=True)
    return state["step"], state["model"]


def final_eval_loss(agent: Agent) -> float:
    """The full-dataset loss on rank 0's ``final step ...`` line."""
    for line in reversed(agent.output().splitlines()):
        if line.startswith("final step") and "eval_loss None" not in line:
            return float(line.split(" eval_loss ")[1].split()[0])
    raise AssertionError(f"no final line in the log of agent {agent.pid}:\n{agent.tail()}")


def kill_rank(agent: Agent, samples: Path, rank: int) -> int:
    """SIGKILL the worker of ``rank`` in the newest generation (it must be ``agent``'s); its pid."""
    newest = generations(samples)[-1]
    pid = newest.pids[rank]
    if pid not in agent.worker_pids():
        raise AssertionError(f"rank {rank} (pid {pid}) is not a worker of agent {agent.pid}: {agent.worker_pids()}")
    os.kill(pid, signal.SIGKILL)
    return pid
