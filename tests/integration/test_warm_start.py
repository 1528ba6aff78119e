"""The warm-start server and client for real: processes, signals, file descriptors, exit codes.

Each test starts a real warm server (preloading a cheap module instead of torch, so the tests are
fast), runs real clients the way torchrun does (``subprocess.Popen``, own session), and checks
that the forked worker behaves as the cold process would have: same argv, environment, working
directory and stdio, exit status passed through, signals forwarded, and never an orphan.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_trainer.launch.warm_start import (
    FAILED_NAME,
    WarmStartServer,
    start_server,
    worker_pids,
)
from elastic_trainer.ops.processes import wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PRELOAD = "xml.dom.minidom"
"""A cheap module neither the client nor a bare interpreter imports: proof of a warm fork."""

WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    out = sys.argv[1]
    def on_term(signum, frame):
        with open(out + ".term", "w") as f:
            f.write(str(signum))
        sys.exit(3)
    signal.signal(signal.SIGTERM, on_term)
    with open(out, "w") as f:
        json.dump({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "sid": os.getsid(0),
                   "env": os.environ.get("WARM_TEST_VALUE"), "warm": "xml.dom.minidom" in sys.modules,
                   "name": __name__}, f)
    print("hello from the worker", flush=True)
    print("and its stderr", file=sys.stderr, flush=True)
    mode = sys.argv[2]
    if mode == "exit":
        sys.exit(int(sys.argv[3]))
    if mode == "raise":
        raise RuntimeError("boom in the worker")
    while True:
        time.sleep(0.05)
""")


@pytest.fixture
def server() -> Iterator[WarmStartServer]:
    warm = start_server([PRELOAD])
    try:
        yield warm
    finally:
        warm.close()


def client(
    warm: WarmStartServer,
    tmp_path: Path,
    *target: str,
    env: dict[str, str] | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start a client the way torchrun starts a worker."""
    cmd = [sys.executable, "-u", *warm.client_args(list(target))]
    return subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )


def looping_worker(warm: WarmStartServer, tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A client whose worker runs until stopped: ``(client, worker pid)`` once the worker is up."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out.json"
    proc = client(warm, tmp_path, str(script), str(out), "loop")
    wait_for(lambda: written(out), timeout=30, what=f"the worker to write {out}")
    return proc, read_json(out)["pid"]


def written(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return False


def wait_dead(pid: int, what: str) -> None:
    wait_for(lambda: not alive(pid), timeout=10, what=what)


def read_json(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def test_wait_ready_returns_once_the_server_serves(server: WarmStartServer) -> None:
    assert server.wait_ready(30) is True
    assert server.socket_path.is_socket()


def test_the_worker_runs_the_script_as_a_cold_process_would(
    server: WarmStartServer, tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out.json"
    with open(tmp_path / "stdout", "wb") as so, open(tmp_path / "stderr", "wb") as se:
        proc = client(
            server,
            tmp_path,
            str(script),
            str(out),
            "exit",
            "7",
            env={"WARM_TEST_VALUE": "from-the-client"},
            stdout=so.fileno(),
            stderr=se.fileno(),
        )
        assert proc.wait(30) == 7
    seen = read_json(out)
    assert seen["argv"] == [str(script), str(out), "exit", "7"]
    assert seen["cwd"] == str(tmp_path)
    assert seen["env"] == "from-the-client"
    assert seen["name"] == "__main__"
    assert seen["warm"] is True  # forked from the server that preloaded it
    assert (
        seen["pid"] != proc.pid and seen["sid"] == seen["pid"]
    )  # its own session, like torchrun's workers
    assert (tmp_path / "stdout").read_text() == "hello from the worker\n"
    assert (tmp_path / "stderr").read_text() == "and its stderr\n"


def test_a_module_target_runs_as_main_with_its_arguments(
    server: WarmStartServer, tmp_path: Path
) -> None:
    package = tmp_path / "warmpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(WORKER)
    out = tmp_path / "out.json"
    proc = client(server, tmp_path, "-m", "warmpkg.job", str(out), "exit", "0")
    assert proc.wait(30) == 0
    seen = read_json(out)
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(package / "job.py"), str(out), "exit", "0"]


def test_an_uncaught_exception_is_printed_and_exits_1(
    server: WarmStartServer, tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = client(
        server, tmp_path, str(script), str(tmp_path / "out.json"), "raise", stderr=subprocess.PIPE
    )
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "RuntimeError: boom in the worker" in err.decode()


def test_sigterm_to_the_client_group_reaches_the_worker(
    server: WarmStartServer, tmp_path: Path
) -> None:
    """torchrun stops workers with killpg(SIGTERM): the worker's handler runs, its status comes back."""
    proc, _ = looping_worker(server, tmp_path)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 3
    assert (tmp_path / "out.json.term").read_text() == str(int(signal.SIGTERM))


def test_a_worker_killed_by_a_signal_is_reported_as_killed_by_it(
    server: WarmStartServer, tmp_path: Path
) -> None:
    proc, worker = looping_worker(server, tmp_path)
    assert worker_pids(os.getpid(), [proc.pid]) == [worker]  # the registry maps client -> worker
    os.kill(worker, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL


def test_killing_the_client_kills_its_worker(server: WarmStartServer, tmp_path: Path) -> None:
    """torchrun's SIGKILL escalation (or a test) hits the client: no orphan worker is left."""
    proc, worker = looping_worker(server, tmp_path)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    wait_dead(worker, f"worker {worker} to end with its client")


def test_when_the_launcher_goes_away_the_server_kills_its_workers(tmp_path: Path) -> None:
    warm = start_server([PRELOAD])
    proc, worker = looping_worker(warm, tmp_path)
    try:
        os.close(
            warm._pipe_write
        )  # what the launcher's exit, even by SIGKILL, does: the pipe closes
        wait_dead(worker, f"worker {worker} to end with the server")
        assert proc.wait(30) != 0
        wait_for(
            lambda: not warm.directory.exists(),
            timeout=10,
            what="the server to remove its directory",
        )
    finally:
        warm.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_server_that_cannot_preload_makes_workers_start_cold(tmp_path: Path) -> None:
    warm = start_server([PRELOAD, "no_such_module_for_warm_start"])
    try:
        assert warm.wait_ready(30) is False and (warm.directory / FAILED_NAME).exists()
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        out = tmp_path / "out.json"
        proc = client(warm, tmp_path, str(script), str(out), "exit", "5", stderr=subprocess.PIPE)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 5  # the job still runs, cold
        warnings = [line for line in err.decode().splitlines() if "warm start unavailable" in line]
        assert len(warnings) == 1 and "no_such_module_for_warm_start" in warnings[0]
        assert read_json(out)["pid"] == proc.pid  # execv: the client became the worker
    finally:
        warm.close()


def test_a_preload_that_imports_prometheus_client_is_refused(tmp_path: Path) -> None:
    """Its multiprocess mode is fixed at import; a worker forked from it would lose its metrics."""
    warm = start_server([PRELOAD, "prometheus_client"])
    try:
        assert warm.wait_ready(30) is False
        assert "prometheus_client" in (warm.directory / FAILED_NAME).read_text()
    finally:
        warm.close()


def test_the_client_alone_is_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.launch.warm_start"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )
    assert done.returncode == 2 and done.stderr.startswith("usage:")


PROBE = textwrap.dedent("""
    import json, os, sys
    warm = "torch" in sys.modules  # before this script imports anything heavy
    with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.json"), "w") as f:
        json.dump({"warm": warm, "ppid": os.getppid(), "pid": os.getpid()}, f)
""")


@pytest.mark.parametrize("mode", ["on", "off"])
def test_elastic_trainer_run_forks_workers_warm_unless_turned_off(
    tmp_path: Path, mode: str
) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elastic_trainer.cli",
            "run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--metrics-port",
            "0",
            "--warm-start",
            mode,
            str(script),
            str(tmp_path),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = launcher.communicate(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, output.decode()[-3000:]
    ranks = [read_json(tmp_path / f"rank-{rank}.json") for rank in (0, 1)]
    assert [r["warm"] for r in ranks] == [mode == "on"] * 2
    assert "warm start unavailable" not in output.decode()
    if mode == "on":  # forked by the node's warm server, not started by the agent
        assert all(r["ppid"] != launcher.pid for r in ranks)
        assert not list(
            Path(tempfile.gettempdir()).glob(f"elastic-trainer-warm-{launcher.pid}-*")
        ), "server directory left behind"
    else:  # started cold by the agent itself, as plain torchrun does
        assert all(r["ppid"] == launcher.pid for r in ranks)
