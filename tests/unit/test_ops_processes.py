"""elastic_trainer.ops.processes on real short-lived processes: a "node" is a python process that
starts "workers" in new sessions, as torchrun does, so killing the node's group alone would leave
them running.

    pytest tests/unit/test_ops_processes.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_trainer.ops.processes import (
    NodeProcess,
    _kill_group,
    children,
    start_process,
    wait_for,
    worker_processes,
)

pytestmark = pytest.mark.timeout(60)

# A node in miniature: N workers in their own sessions, each with a grandchild in its group.
NODE = """
import subprocess, sys, time
WORKER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"
workers = [subprocess.Popen([sys.executable, "-c", WORKER], start_new_session=True) for _ in range(int(sys.argv[1]))]
print("node up with", len(workers), "workers", flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    """Running (a zombie left for a parent that does not reap counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    """A node with two workers, stopped at the end."""
    started = start_process([sys.executable, "-c", NODE, "2"], tmp_path / "node.log")
    try:
        wait_for(lambda: len(started.worker_pids()) == 2 and all(children(w) for w in started.worker_pids()),
                 timeout=30, what="two workers with a child each", describe=started.tail)  # fmt: skip
        yield started
    finally:
        started.stop()


def test_the_log_starts_with_the_command_and_holds_the_output(node: NodeProcess) -> None:
    wait_for(lambda: "node up with 2 workers" in node.output(), timeout=10, what="the node's line")
    assert node.output().startswith(f"$ {sys.executable} -c {NODE} 2\n")
    assert node.tail(1) == "node up with 2 workers"
    assert node.poll() is None


def test_children_and_worker_processes_list_the_workers(node: NodeProcess) -> None:
    workers = children(node.pid)
    assert len(workers) == 2 and all(alive(pid) for pid in workers)
    # No warm-start server here: the workers are the node's children.
    assert sorted(worker_processes(node.pid)) == sorted(workers) == sorted(node.worker_pids())
    assert children(workers[0]) and children(workers[0])[0] not in workers


def test_children_of_a_process_that_is_gone_is_empty(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=30)  # fmt: skip
    assert children(int(done.stdout)) == []


def test_kill_worker_kills_one_worker_by_index(node: NodeProcess) -> None:
    workers = sorted(node.worker_pids())
    killed = node.kill_worker(3)  # modulo the number of workers: the second
    assert killed == workers[1]
    wait_for(lambda: not alive(killed), timeout=10, what="the worker to die")
    assert alive(workers[0]) and node.poll() is None


def test_kill_worker_without_workers_names_the_node(tmp_path: Path) -> None:
    with start_process(
        [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "lone.log"
    ) as lone:
        match = f"node {lone.pid} has no worker to kill"
        with pytest.raises(ProcessLookupError, match=match):
            lone.kill_worker()


def test_kill_node_leaves_nothing_of_the_node_alive(node: NodeProcess) -> None:
    everything = [node.pid, *descendants(node.pid)]
    assert len(everything) == 5  # the node, two workers, a child of each

    node.kill_node()

    assert node.poll() == -signal.SIGKILL
    wait_for(lambda: not any(alive(pid) for pid in everything), timeout=10, what="every process to die",
             describe=lambda: f"alive: {[pid for pid in everything if alive(pid)]}")  # fmt: skip
    node.kill_node()  # gone already: nothing happens


def test_terminate_sends_sigterm_and_wait_returns_the_status(node: NodeProcess) -> None:
    node.terminate()
    assert node.wait(10) == -signal.SIGTERM
    node.terminate()  # exited: no error


def test_wait_on_a_running_node_fails_with_its_log(node: NodeProcess) -> None:
    wait_for(lambda: "node up" in node.output(), timeout=10, what="the node's line")
    with pytest.raises(
        TimeoutError, match=rf"node {node.pid} still running after 0.1 s:\n(.|\n)*node up with 2"
    ) as raised:
        node.wait(0.1)
    tree = (
        str(raised.value)
        .split("processes still running:\n", 1)[1]
        .split("\nits Python stacks:\n")[0]
        .splitlines()
    )
    assert tree[0].startswith(f"{node.pid} ") and " wchan=" in tree[0], (
        tree
    )  # the node, then its processes
    assert len(tree) == 1 + len(descendants(node.pid)) and all(
        line.startswith("  ") for line in tree[1:]
    ), tree


def test_wait_on_a_running_node_names_each_thread_and_shows_its_python_stacks(
    node: NodeProcess,
) -> None:
    """What a hung node's threads wait on (kernel) and where (Python): the first CI hang of an
    agent at exit gave only its main thread's wait channel."""
    wait_for(lambda: "node up" in node.output(), timeout=10, what="the node's line")
    with pytest.raises(TimeoutError) as raised:
        node.wait(0.1)
    tree, stacks = (
        str(raised.value).split("processes still running:\n", 1)[1].split("\nits Python stacks:\n")
    )
    assert re.search(r" threads=1 \[[^@\]]+@[a-z_]+\] ", tree.splitlines()[0]), (
        tree
    )  # name@wait channel
    if (
        os.geteuid() == 0
    ):  # py-spy needs ptrace rights on a process that is not its child (CI runs as root)
        assert (
            f"Process {node.pid}:" in stacks and '"MainThread"' in stacks and "<module>" in stacks
        ), stacks
    else:
        assert stacks.strip(), "no Python stacks and no reason why"


def test_stop_is_safe_twice_and_after_an_exit(tmp_path: Path) -> None:
    node = start_process([sys.executable, "-c", "print('bye')"], tmp_path / "short.log",
                         env=dict(os.environ, EXTRA="1"), cwd=tmp_path)  # fmt: skip
    assert node.wait(30) == 0
    node.stop()
    node.stop()
    assert node.output().splitlines()[-1] == "bye"


def test_the_environment_given_is_the_whole_environment(tmp_path: Path) -> None:
    show = "import os; print(sorted(k for k in os.environ if k.startswith('ET_PROC_TEST')))"
    with start_process([sys.executable, "-c", show], tmp_path / "env.log",
                       env={"ET_PROC_TEST_A": "1", "PATH": os.environ.get("PATH", "")}) as proc:  # fmt: skip
        assert proc.wait(30) == 0
    assert proc.tail(1) == "['ET_PROC_TEST_A']"


def test_a_process_group_shared_with_the_caller_is_never_signalled() -> None:
    """A process in this test's own group: only it dies (the test survives to assert so)."""
    same_group = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert os.getpgid(same_group.pid) == os.getpgrp()
        _kill_group(same_group.pid)
        assert same_group.wait(10) == -signal.SIGKILL
    finally:
        same_group.kill()
        same_group.wait(10)


# -- wait_for -------------------------------------------------------------------------------------
def test_wait_for_returns_the_first_truthy_value() -> None:
    answers = iter([None, 0, [], "ready"])
    assert wait_for(lambda: next(answers), timeout=10, what="an answer", interval=0.001) == "ready"


def test_wait_for_times_out_with_what_and_the_description() -> None:
    calls = []
    with pytest.raises(TimeoutError) as raised:
        wait_for(lambda: calls.append(1), timeout=0.05, what="step 7", describe=lambda: "--- node a ---\nlast line",
                 interval=0.01)  # fmt: skip
    assert (
        str(raised.value) == "timed out after 0.05 s waiting for step 7\n--- node a ---\nlast line"
    )
    assert len(calls) >= 2  # tried at the start and at the deadline


def test_wait_for_tries_once_even_with_no_time() -> None:
    assert wait_for(lambda: 5, timeout=0, what="five") == 5


def test_wait_for_retries_the_errors_named_and_reports_the_last() -> None:
    attempts = iter([ConnectionRefusedError("refused"), KeyError("step"), "up"])

    def probe() -> str:
        answer = next(attempts)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert (
        wait_for(probe, timeout=10, what="the server", retry_on=(OSError, KeyError), interval=0.001)
        == "up"
    )

    def refused() -> bool:
        raise ConnectionRefusedError("refused")

    with pytest.raises(
        TimeoutError,
        match=r"waiting for the server \(last error: ConnectionRefusedError: refused\)$",
    ):
        wait_for(refused, timeout=0.02, what="the server", retry_on=(OSError,), interval=0.005)


def test_wait_for_lets_other_errors_through_at_once() -> None:
    calls = []

    def broken() -> bool:
        calls.append(1)
        raise ValueError("bad answer")

    with pytest.raises(ValueError, match="bad answer"):
        wait_for(broken, timeout=30, what="never", retry_on=(OSError,))
    assert calls == [1]


def test_the_janitor_sweep_removes_what_dead_launchers_left_and_nothing_else(
    tmp_path: Path,
) -> None:
    """A launcher SIGKILLed together with its janitor leaves its metrics and warm-start
    directories; the next launcher removes those whose pid runs nothing (issue 31)."""
    from elastic_trainer.launch.janitor import sweep_stale

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = [
        tmp_path / f"elastic-trainer-metrics-{gone.pid}-abc",
        tmp_path / f"elastic-trainer-warm-{gone.pid}-def",
    ]
    alive = [
        tmp_path / f"elastic-trainer-metrics-{os.getpid()}-ghi",
        tmp_path / "elastic-trainer-metrics-xyz",
        tmp_path / f"elastic-trainer-etcd-{gone.pid}-jkl",
    ]
    for path in [*dead, *alive]:
        path.mkdir()
        (path / "counter_1.db").write_bytes(b"x")
    assert sorted(sweep_stale(tmp_path)) == sorted(dead)
    assert [p for p in [*dead, *alive] if p.exists()] == alive


def test_the_janitor_sweep_trusts_the_owner_lock_over_the_pid(tmp_path: Path) -> None:
    """A launcher in another pid namespace sharing the temp dir has a pid that runs nothing
    here; its lock keeps its directory. Once it ends (the lock dropped) the directory goes."""
    from elastic_trainer.launch.janitor import OwnedDir, sweep_stale

    owned = OwnedDir("elastic-trainer-metrics-", tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    elsewhere = owned.path.rename(tmp_path / f"elastic-trainer-metrics-{gone.pid}-abc")
    assert sweep_stale(tmp_path) == []
    assert elsewhere.is_dir()
    owned.release()
    assert sweep_stale(tmp_path) == [elsewhere]
    assert not elsewhere.exists()
