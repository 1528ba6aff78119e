"""Run isolation under `elastic-trainer run`: a second job that reuses a running job's run id is
refused in one line (exit 2, within seconds), and the running job is not disturbed: it finishes
without a restart. The launcher declares the real target, also when workers start warm."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_trainer.ops.processes import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]


def _launch(endpoint: str, run_id: str, *job: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "elastic_trainer.cli",
        "run",
        "--rdzv-endpoint",
        endpoint,
        "--run-id",
        run_id,
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--metrics-port",
        "0",
        "-m",
        "elastic_trainer.examples.synthetic_cnn",
        *job,
    ]


def test_a_second_job_with_the_same_run_id_is_refused_and_the_first_is_untouched(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "first.log"
    with open(log, "wb") as out:
        first = subprocess.Popen(
            _launch(
                etcd_server.endpoint,
                unique_id,
                "--max-steps",
                "150",
                "--epochs",
                "10",
                "--throttle-ms",
                "40",
                "--checkpoint-dir",
                str(tmp_path / "a"),
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
    try:
        wait_for(lambda: "step 20 " in log.read_text(), timeout=90, what="the first job to train")
        started = time.monotonic()
        second = subprocess.run(
            _launch(
                etcd_server.endpoint,
                unique_id,
                "--max-steps",
                "150",
                "--width",
                "8",
                "--checkpoint-dir",
                str(tmp_path / "b"),
            ),
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=90,
        )
        took = time.monotonic() - started
        assert second.returncode == 2, second.stderr[-3000:]
        lines = [line for line in second.stderr.splitlines() if "in use by another job" in line]
        assert len(lines) == 1 and f"run id {unique_id!r}" in lines[0], second.stderr[-3000:]
        assert "--width 8" in lines[0], "it says what this node runs"
        assert "Traceback" not in second.stderr
        assert took < 60, f"refused after {took:.0f} s"
        assert first.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    output = log.read_text()
    assert "restarting the worker group" not in output and "received SIGTERM" not in output, (
        "not disturbed"
    )
    assert "training finished at step 150" in output
