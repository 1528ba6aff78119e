"""Start torchrun agents as separate processes and inject node-level faults into them.

torchrun starts its workers with ``start_new_session=True``: killing the agent's process group
leaves the workers running (see shared/notes). :meth:`Agent.kill_node` therefore freezes the
agent, SIGKILLs each worker's process group, then SIGKILLs the agent -- a node that vanished.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    found: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    with contextlib.suppress(OSError):
        for task in task_dir.iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found


def worker_processes(agent_pid: int) -> list[int]:
    """The processes running the training target under an agent: its children, with a warm-start
    client replaced by the worker the node's warm server forked for it (the process a real fault
    would hit)."""
    from elastic_trainer.launch.warm_start import worker_pids

    return worker_pids(agent_pid, children(agent_pid))


class Agent:
    """One torchrun agent (a 'node') running ``script`` with ``torchrun_args``."""

    def __init__(self, torchrun_args: Sequence[str], script: Sequence[str], log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 -- closed in wait()/kill_node()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *torchrun_args, *script],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def worker_pids(self) -> list[int]:
        return worker_processes(self.process.pid)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def kill_worker(self, timeout: float = 30.0) -> int:
        """SIGKILL one worker of this agent once it has one; return its pid."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.worker_pids()
            if pids:
                os.kill(pids[-1], signal.SIGKILL)
                return pids[-1]
            time.sleep(0.05)
        raise TimeoutError("the agent started no worker")

    def kill_node(self) -> None:
        """The node vanishes: agent frozen, its workers' groups killed, then the agent killed."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGSTOP)
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        self._log.close()

    def terminate(self) -> None:
        """Best-effort cleanup: kill everything this agent started."""
        if self.process.poll() is None:
            self.kill_node()
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def agents_cleanup() -> Iterator[list[Agent]]:
    """Collects agents; kills whatever is left of them when the test ends, pass or fail."""
    started: list[Agent] = []
    try:
        yield started
    finally:
        for agent in started:
            agent.terminate()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
