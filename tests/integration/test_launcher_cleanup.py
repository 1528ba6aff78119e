"""Nothing outlives `elastic-trainer run`: SIGKILL the launcher (no `finally` runs) and its
embedded etcd, the etcd data directory, the metrics directory, the warm-start server and every
worker are gone within seconds. A SIGTERM exit leaves nothing either, and the launcher ends
within a second of its last child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_trainer.ops.processes import children, wait_for, worker_processes
from rendezvous.etcd_server import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
CNN_JOB = ("-m", "elastic_trainer.examples.synthetic_cnn", "--epochs", "50", "--throttle-ms", "50")
"""The long-running job the launcher tests stop (add ``--checkpoint-dir``)."""


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if text.encode() in (entry / "cmdline").read_bytes():
                state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])


def _launcher_marker(pid: int) -> str | None:
    try:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"ELASTIC_TRAINER_LAUNCHER_ID="):
                return item.decode()
    except OSError:
        return None
    return None


def _processes_with_item(item: bytes) -> list[int]:
    """Processes (not zombies) whose environment holds ``item`` (``NAME=value``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if item in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def _wait_launcher_directories_gone(tmp_path: Path) -> None:
    """Until no ``elastic-trainer-*`` directory (etcd data, metrics) is left in ``tmp_path``."""
    wait_for(
        lambda: not [p for p in tmp_path.iterdir() if p.name.startswith("elastic-trainer-")],
        timeout=10,
        what="every directory of the launcher to go",
        describe=lambda: str(list(tmp_path.iterdir())),
    )


def _start_launcher(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    """``elastic-trainer run --nproc-per-node 2 ARGS`` in its own session, its temporary files in
    ``tmp_path`` (``TMPDIR``: every process it starts carries it), output in ``launcher.log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    with open(tmp_path / "launcher.log", "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "elastic_trainer.cli", "run", "--nproc-per-node", "2",
             "--metrics-port", str(free_port()), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )  # fmt: skip


@pytest.mark.parametrize("warm", ["on", "off"])
def test_sigkilled_launcher_leaves_nothing_behind(tmp_path: Path, warm: str) -> None:
    log = tmp_path / "launcher.log"
    launcher = _start_launcher(
        tmp_path,
        "--warm-start",
        warm,
        *CNN_JOB,
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    )
    try:
        wait_for(lambda: "step 10 " in log.read_text(), timeout=90, what="training to run")
        (data_dir,) = [
            str(p) for p in tmp_path.iterdir() if p.name.startswith("elastic-trainer-etcd-")
        ]
        etcd = _processes_mentioning(data_dir)
        assert etcd, "the embedded etcd runs with its data directory"
        # It runs lean beside the training (one Go processor, a 100 ms raft tick): the CPU it
        # takes in steady state is the workers' (benchmarks/RESULTS.md, issue 30).
        assert b"GOMAXPROCS=1" in Path(f"/proc/{etcd[0]}/environ").read_bytes().split(b"\0")
        assert b"--heartbeat-interval\x00100\x00" in Path(f"/proc/{etcd[0]}/cmdline").read_bytes()
        workers = [
            pid for pid in _processes_mentioning(str(tmp_path / "ckpt")) if pid != launcher.pid
        ]  # this test's own
        marker = _launcher_marker(workers[0]) if workers else None
        assert marker, f"workers carry the launcher's marker: {workers}"
        janitors = _processes_mentioning("elastic_trainer.launch.janitor")
        assert janitors and all(_parent(pid) != launcher.pid for pid in janitors), (
            "the janitor is no worker-like child"
        )
        assert [p for p in tmp_path.iterdir() if p.name.startswith("elastic-trainer-metrics-")], (
            "metrics on"
        )
        before = set(_processes_with_item(marker.encode()))
        assert len(before) >= 3, f"etcd, workers (and a warm server): {before}"
        launcher.kill()
        launcher.wait(10)
        wait_for(
            lambda: not _processes_with_item(marker.encode()),
            timeout=15,
            what="every process of the launcher to end",
        )
        wait_for(
            lambda: not Path(data_dir).exists(), timeout=10, what="the etcd data directory to go"
        )
        assert not _processes_mentioning(data_dir), "etcd is gone"
        # The janitor removes the directories one after another: the etcd one first.
        _wait_launcher_directories_gone(tmp_path)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _processes_mentioning(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)


def test_a_sigterm_exit_is_prompt_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGTERM: the workers checkpoint and go, etcd stops, and the launcher follows its last
    child within a second (it took 7 s: the warm server's and its own interpreter teardown, and a
    lease revoke retried against the etcd it had already stopped)."""
    log = tmp_path / "launcher.log"
    launcher = _start_launcher(
        tmp_path,
        *CNN_JOB,
        "--checkpoint-dir",
        str(tmp_path / "c"),
    )
    try:
        wait_for(lambda: "step 10 " in log.read_text(), timeout=90, what="training to run")
        marker = _launcher_marker(worker_processes(launcher.pid)[0])
        assert marker, "workers carry the launcher's marker"
        launcher.send_signal(signal.SIGTERM)
        last_child = time.monotonic()
        while launcher.poll() is None:
            # Its children (etcd, warm clients) and every process it started elsewhere (the warm
            # server and its workers carry its marker); none may be waited for in vain.
            if children(launcher.pid) or _processes_with_item(marker.encode()):
                last_child = time.monotonic()
            time.sleep(0.02)
        exited = time.monotonic()
        assert launcher.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
        print(f"launcher exited {exited - last_child:.2f} s after its last child")
        assert exited - last_child < 1.0, log.read_text()[-3000:]
        wait_for(
            lambda: not _processes_mentioning(str(tmp_path)), timeout=10, what="no process left"
        )
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("elastic-trainer-")], list(
            tmp_path.iterdir()
        )
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_a_normal_exit_leaves_nothing_behind(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_trainer.cli",
            "run",
            "--nproc-per-node",
            "2",
            "--metrics-port",
            "0",
            "-m",
            "elastic_trainer.examples.synthetic_cnn",
            "--max-steps",
            "5",
            "--checkpoint-dir",
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"run took {time.monotonic() - started:.1f} s")
    wait_for(lambda: not _processes_mentioning(str(tmp_path)), timeout=10, what="no process left")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("elastic-trainer-")], list(
        tmp_path.iterdir()
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_starting_is_one_line_and_leaves_nothing_behind(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """A node preempted while its launcher starts (etcd, the warm server, the janitor, torch's
    imports; no worker runs yet): one line, the signal's exit status (a scheduler reads 1 as a
    failure), no traceback, nothing left (it printed a traceback and exited 1)."""
    script = tmp_path / "tiny.py"
    script.write_text("import time\ntime.sleep(60)\n")
    log = tmp_path / "launcher.log"
    launcher = _start_launcher(tmp_path, str(script))
    try:
        # Signalled as soon as its embedded etcd is up: the launcher is then still waiting for its
        # warm server's imports of torch (seconds), on a quiet machine as on a loaded one (a fixed
        # delay was too late on a quiet one: the agent had started).
        wait_for(
            lambda: "embedded etcd on" in log.read_text(),
            timeout=60,
            interval=0.02,
            what="the embedded etcd",
        )
        launcher.send_signal(signum)
        launcher.wait(30)
        output = log.read_text()
        assert launcher.returncode == 128 + signum, output
        assert "Traceback" not in output, output
        assert f"stopped by {signum.name} while starting" in output, output
        wait_for(
            lambda: not _processes_with_item(f"TMPDIR={tmp_path}".encode()),
            timeout=10,
            what="every process of the launcher to end",
        )
        _wait_launcher_directories_gone(tmp_path)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in _processes_with_item(f"TMPDIR={tmp_path}".encode()):
            os.kill(pid, signal.SIGKILL)
