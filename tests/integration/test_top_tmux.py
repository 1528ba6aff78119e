"""``elastic-trainer top`` in a real terminal: tmux runs it against a real node endpoint.

The endpoint is the launcher's (``start_launcher_metrics``) with two real worker processes
writing steps through ``worker_observer()``, rank 1 slower than rank 0. tmux (a private server
socket, a 120x40 window) runs ``python -m elastic_trainer.ops.top``; ``capture-pane`` reads the
screen, ``send-keys q`` must end it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_trainer.launch.node_metrics import LauncherMetricsConfig, start_launcher_metrics
from elastic_trainer.ops.processes import wait_for
from rendezvous.etcd_server import free_port
from tests.support.ci import IN_CI

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
TMUX = shutil.which("tmux") or "/usr/bin/tmux"

WORKER = """
import sys, time
from elastic_trainer.metrics.worker import worker_observer
obs = worker_observer()
obs.on_start(world_size=2, restart_count=0, total_steps=1000)
step_s = float(sys.argv[1])
for step in range(1, 1000):
    obs.on_step(step=step, duration_s=step_s, data_wait_s=0.0, samples=32, tokens=0, loss=2.0 / step, lr=0.05)
    time.sleep(step_s)
time.sleep(600)
"""


@pytest.fixture
def tmux() -> Iterator[list[str]]:
    """``tmux -L <private socket>``; the server is killed at the end."""
    if not os.access(TMUX, os.X_OK):
        if IN_CI:
            pytest.fail("CI must have tmux")
        pytest.skip("tmux not installed (apt-get install tmux)")
    command = [TMUX, "-L", f"et-top-{uuid.uuid4().hex[:8]}", "-f", "/dev/null"]
    try:
        yield command
    finally:
        subprocess.run([*command, "kill-server"], capture_output=True, timeout=30)


@contextlib.contextmanager
def workers(run_id: str, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, step_s in ((0, 0.02), (1, 0.05)):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), TORCHELASTIC_RUN_ID=run_id,
                       OMP_NUM_THREADS="1")  # fmt: skip
            with open(tmp_path / f"worker{rank}.log", "wb") as log:
                procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(step_s)], env=env, stdout=log,
                                              stderr=subprocess.STDOUT))  # fmt: skip
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)


def screen(tmux: list[str]) -> str:
    done = subprocess.run(
        [*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True, timeout=30
    )
    return done.stdout if done.returncode == 0 else ""


def test_top_shows_the_job_live_and_q_quits(
    tmp_path: Path, tmux: list[str], unique_id: str
) -> None:
    config = LauncherMetricsConfig(addr="127.0.0.1", port=0, run_id=unique_id, node="host-a-101",
                                   multiproc_dir=str(tmp_path / "multiproc"))  # fmt: skip
    with start_launcher_metrics(config) as metrics, workers(unique_id, tmp_path):
        down = f"127.0.0.1:{free_port()}"  # nothing listens there
        command = f"{sys.executable} -m elastic_trainer.ops.top --url {metrics.url} --url {down} --interval 1"
        subprocess.run([*tmux, "new-session", "-d", "-s", "top", "-x", "120", "-y", "40", "-c", str(REPO),
                        "-e", f"PYTHONPATH={REPO}", command], check=True, timeout=30)  # fmt: skip

        def step_on_screen(after: int) -> tuple[int, str] | None:
            text = screen(tmux)
            match = re.search(r"step\s+(\d+) / 1000", text)
            return (int(match.group(1)), text) if match and int(match.group(1)) > after else None

        first, _ = wait_for(lambda: step_on_screen(0), timeout=120, what="top to show the step and the target",
                            interval=0.2)  # fmt: skip
        # Redrawn in place: a later frame shows a later step, and the screen has one header.
        wait_for(lambda: step_on_screen(first), timeout=60, what="top to refresh", interval=0.2)

        def with_rates() -> str | None:
            text = screen(tmux)
            return (
                text
                if "slowest     rank 1 on host-a-101" in text and "ETA         -" not in text
                else None
            )

        text = wait_for(
            with_rates, timeout=60, what="the rates, the ETA and the slower rank 1", interval=0.2
        )
        assert text.count("elastic-trainer top") == 1 and f"run {unique_id}" in text
        assert "world size  2" in text and "lr 0.05" in text and "q quits" in text
        assert re.search(r"up\s+host-a-101\s+ranks 0,1", text)
        assert f"DOWN  http://{down}/metrics" in text
        assert "endpoints   1 of 2 up" in text

        subprocess.run([*tmux, "send-keys", "-t", "top", "q"], check=True, timeout=30)

        def ended() -> bool:
            alive = subprocess.run(
                [*tmux, "has-session", "-t", "top"], capture_output=True, timeout=30
            )
            return alive.returncode != 0

        wait_for(
            ended, timeout=30, what="q to end top (its tmux session closes with it)", interval=0.2
        )
