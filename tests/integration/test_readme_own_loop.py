"""The README's own-loop snippet, as written, completed with nothing but a model and a dataset:
under `elastic-trainer run` (two workers) one worker is SIGKILLed mid-run, the group heals in
place, and the final weights are bitwise those of an undisturbed run of the same snippet."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.ops.processes import wait_for, worker_processes
from tests.support.agents import FAST_RDZV_CONF
from tests.support.records import final_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]

COMPLETION = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
inputs = torch.randn(320, 8, generator=torch.Generator().manual_seed(1))
dataset = TensorDataset(inputs, inputs[:, :4].argmax(1))
"""
"""A model and a dataset: all the test adds to the snippet."""


def readme_snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Your own training loop") :]
    section = section[: section.index("\n## ", 3)]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "the own-loop section shows a python block"
    return block.group(1)


def test_the_snippet_shows_what_a_user_needs() -> None:
    snippet = readme_snippet()
    assert "from elastic_trainer import Elastic" in snippet and "import torch" in snippet, (
        "its imports"
    )
    assert "micro_batch_size=" in snippet and "for x, y in step:" in snippet, (
        "gradient accumulation"
    )
    assert "step.backward(loss * step.weight)" in snippet, "the loss weighting across world sizes"
    assert "sys.exit(elastic.result.exit_code)" in snippet
    assert len(snippet.splitlines()) <= 25


def _launch(directory: Path, run_id: str, endpoint: str) -> subprocess.Popen[bytes]:
    directory.mkdir(parents=True)
    (directory / "train.py").write_text(COMPLETION + readme_snippet())
    log = open(directory / "run.log", "wb")  # noqa: SIM115 - closed by the process's end
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elastic_trainer.cli",
            "run",
            "--rdzv-endpoint",
            endpoint,
            "--run-id",
            run_id,
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--metrics-port",
            "0",
            "--rdzv-conf",
            FAST_RDZV_CONF,
            "train.py",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=directory,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )


def test_the_readme_snippet_heals_a_sigkilled_worker_in_place_bitwise(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    reference = _launch(tmp_path / "ref", f"{unique_id}-ref", etcd_server.endpoint)
    faulty = _launch(tmp_path / "faulty", unique_id, etcd_server.endpoint)
    checkpoints = tmp_path / "faulty" / "checkpoints"
    try:
        wait_for(
            lambda: ckpt.newest_step(checkpoints) if checkpoints.is_dir() else None,
            timeout=120,
            what="the first checkpoint",
            describe=lambda: (tmp_path / "faulty" / "run.log").read_text()[-3000:],
        )
        workers = wait_for(
            lambda: (
                worker_processes(faulty.pid) if len(worker_processes(faulty.pid)) == 2 else None
            ),
            timeout=30,
            what="two workers",
        )
        os.kill(workers[-1], signal.SIGKILL)
        assert faulty.wait(240) == 0, (tmp_path / "faulty" / "run.log").read_text()[-3000:]
        assert reference.wait(240) == 0, (tmp_path / "ref" / "run.log").read_text()[-3000:]
    finally:
        for proc in (reference, faulty):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "faulty" / "run.log").read_text()
    assert "healed in place" in log, log[-3000:]
    assert "restarting the worker group" not in log, "healed in place, not restarted"
    step, weights = final_model(checkpoints)
    ref_step, expected = final_model(tmp_path / "ref" / "checkpoints")
    assert step == ref_step == 1000, (
        "max_steps alone runs to max_steps (32 epochs of 10 steps each)"
    )
    assert weights.keys() == expected.keys()
    for name in weights:
        assert torch.equal(weights[name], expected[name]), f"{name} differs from the fault-free run"
