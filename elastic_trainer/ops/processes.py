"""Drive real nodes from outside: start one, find its workers, inject process faults, wait.

Runs in: the operator's shell (``elastic-trainer demo``), the test suites and the benchmarks.
Stdlib only (it never imports torch); Linux (``/proc``).

A *node* is one ``torchrun`` agent or ``elastic-trainer run`` launcher process, started by
:func:`start_process` in its own session with its output in a log file::

    node = start_process([sys.executable, "-m", "elastic_trainer.cli", "run", ...], Path("a.log"))
    try:
        wait_for(lambda: node.worker_pids(), timeout=60, what="a worker", describe=node.tail)
        node.kill_worker(0)
        if node.wait(300) != 0:
            raise RuntimeError(f"the node failed:\n{node.tail()}")
    finally:
        node.stop()

Invariants:

* torchrun starts every worker with ``start_new_session=True``: a signal to the agent's process
  group never reaches them. :meth:`NodeProcess.kill_node` (a node that vanished) therefore
  freezes the agent so it restarts nobody, SIGKILLs the process group of each of its children and
  workers, then the agent's own group.
* With warm start the agent's children are warm clients; :func:`worker_processes` resolves each
  to the worker the node's warm server forked for it (the process a real fault hits), through
  :func:`elastic_trainer.launch.warm_start.worker_pids`.
* A process group is signalled only when it is not the caller's own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TypeVar

from elastic_trainer.launch.warm_start import worker_pids as _resolve_warm_clients

T = TypeVar("T")

STOP_WAIT_S = 30.0
"""How long :meth:`NodeProcess.kill_node` waits for the SIGKILLed agent to be reaped."""


def children(pid: int) -> list[int]:
    """Direct children of ``pid``, from ``/proc/PID/task/*/children``; [] once it is gone."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(child) for child in (task / "children").read_text().split()]
    return found


def describe_tree(pid: int) -> str:
    """``pid`` and every process under it, one line each: pid, state, kernel wait channel, its
    threads by name and wait channel, and command line (which process of a hung node is still
    there, and where each of its threads waits)."""
    lines: list[str] = []
    pending = [(pid, 0)]
    while pending:
        current, depth = pending.pop()
        proc = Path(f"/proc/{current}")
        try:
            stat = (proc / "stat").read_text()
            state = stat[stat.rindex(")") + 2 :].split()[0]
            wchan = (proc / "wchan").read_text().strip() or "-"
            argv = " ".join(
                (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
            )
            threads = _threads(proc)
        except (OSError, ValueError, IndexError):  # it exited meanwhile
            continue
        named = ", ".join(
            f"{name}@{where}" + (f" x{n}" if n > 1 else "") for (name, where), n in threads.items()
        )
        lines.append(
            f"{'  ' * depth}{current} {state} wchan={wchan} threads={threads.total()} [{named}] {argv[:160]}"
        )
        pending += [(child, depth + 1) for child in reversed(children(current))]
    return "\n".join(lines)


def _threads(proc: Path) -> Counter[tuple[str, str]]:
    """A process's threads counted by (name, kernel wait channel); one that ended is skipped."""
    found: Counter[tuple[str, str]] = Counter()
    for task in (proc / "task").iterdir():
        with contextlib.suppress(OSError):
            found[
                ((task / "comm").read_text().strip(), (task / "wchan").read_text().strip() or "-")
            ] += 1
    return found


def python_stacks(pid: int, timeout: float = 15.0) -> str:
    """Every thread's Python stack in process ``pid`` (``py-spy dump``; needs ptrace rights), or
    a line saying why there are none: what a hung process was doing, for a timeout's error."""
    beside = Path(sys.executable).with_name("py-spy")
    tool = str(beside) if beside.exists() else shutil.which("py-spy")
    if tool is None:
        return "(no Python stacks: py-spy is not installed)"
    try:
        done = subprocess.run(
            [tool, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(no Python stacks: {exc})"
    return (done.stdout + done.stderr).strip()


def worker_processes(launcher_pid: int) -> list[int]:
    """The processes running the training target under a torchrun agent or launcher: its
    children, each warm-start client replaced by the worker forked for it."""
    return _resolve_warm_clients(launcher_pid, children(launcher_pid))


def wait_for(
    condition: Callable[[], T],
    *,
    timeout: float,
    what: str,
    describe: Callable[[], str] | None = None,
    interval: float = 0.05,
    retry_on: tuple[type[Exception], ...] = (),
) -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something truthy; return that.

    Args:
        timeout: seconds (``time.monotonic()``) before giving up; ``condition`` is tried at
            least once, and once more at the deadline.
        what: what is awaited, for the error (``"step 7"``).
        describe: called on timeout; its text (node logs, a server's state) ends the error.
        retry_on: exceptions of ``condition`` that mean "not yet" (a server still starting);
            the last one is named in the error. Any other exception propagates at once.

    Raises:
        TimeoutError: ``timed out after T s waiting for WHAT``, then ``describe()``'s text.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = condition()
        except retry_on as exc:
            last_error = exc
        else:
            if value:
                return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(interval, remaining))
    message = f"timed out after {timeout:g} s waiting for {what}"
    if last_error is not None:
        message += f" (last error: {type(last_error).__name__}: {last_error})"
    if describe is not None:
        message += "\n" + describe()
    raise TimeoutError(message)


def _kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group of ``pid`` (only to ``pid`` when that group is ours)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        group = os.getpgid(pid)
        if group == os.getpgrp():
            os.kill(pid, sig)
        else:
            os.killpg(group, sig)


class NodeProcess:
    """One started node: ``torchrun`` or ``elastic-trainer run``, with its output in ``log_path``.

    Made by :func:`start_process`; :meth:`stop` (or leaving a ``with`` block) always cleans up.
    """

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, log_file: IO[bytes]) -> None:
        self.proc = proc
        """The launcher process (``poll()``, ``returncode``)."""
        self.log_path = log_path
        self._log_file = log_file

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"NodeProcess(pid={self.pid}, log={self.log_path})"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        return self.proc.poll()

    def worker_pids(self) -> list[int]:
        """Its current worker processes (see :func:`worker_processes`)."""
        return worker_processes(self.pid)

    def kill_worker(self, index: int = 0) -> int:
        """SIGKILL one worker: ``index`` into the sorted worker pids (modulo their number).

        Returns:
            The pid killed.

        Raises:
            ProcessLookupError: the node has no worker now.
        """
        pids = sorted(self.worker_pids())
        if not pids:
            raise ProcessLookupError(f"node {self.pid} has no worker to kill")
        pid = pids[index % len(pids)]
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_node(self) -> None:
        """The node vanishes: the agent is frozen, the process group of each of its children and
        workers SIGKILLed, then the agent's group; waits until the agent is reaped. Nothing
        happens once the agent has exited (its pid may belong to another process by then)."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGSTOP)  # it must not restart the workers killed next
        for pid in dict.fromkeys([*children(self.pid), *self.worker_pids()]):
            _kill_group(pid)
        _kill_group(self.pid)
        self.proc.wait(STOP_WAIT_S)

    def terminate(self) -> None:
        """SIGTERM the launcher, as a preempted or scaled-down node gets (it stops its workers)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """Its exit status once it exits.

        Raises:
            TimeoutError: still running after ``timeout`` seconds (the error ends with its log,
                then the processes still running under it, :func:`describe_tree`, then the node
                process's Python stacks, :func:`python_stacks`).
        """
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"node {self.pid} still running after {timeout:g} s:\n{self.tail()}\n"
                f"processes still running:\n{describe_tree(self.pid)}\n"
                f"its Python stacks:\n{python_stacks(self.pid)}"
            ) from None

    def output(self) -> str:
        """Everything in its log so far (its command line first)."""
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of :meth:`output`."""
        return "\n".join(self.output().splitlines()[-lines:])

    def stop(self) -> None:
        """Clean-up, safe to call again: a running node is killed with everything it started
        (:meth:`kill_node`), and the log file is closed."""
        try:
            self.kill_node()
        finally:
            self._log_file.close()


def start_process(
    cmd: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    *,
    cwd: Path | None = None,
) -> NodeProcess:
    """Start ``cmd`` in a new session, stdout and stderr appended to ``log_path`` after a
    ``$ CMD`` line.

    Args:
        env: the process's whole environment (None: this process's).
        cwd: its working directory (None: this process's).
    """
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed by NodeProcess.stop
    try:
        log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        log_file.flush()
        proc = subprocess.Popen(
            list(cmd),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=True,
        )
    except BaseException:
        log_file.close()
        raise
    return NodeProcess(proc, log_path, log_file)
