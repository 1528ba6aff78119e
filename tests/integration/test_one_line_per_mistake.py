"""One line per mistake (issue 40 item 5): an optimizer built after ``Elastic`` is refused with its
sentence printed once under ``elastic-trainer run`` (by the launcher: the ranks, the just-in-time
save and torch's agent do not repeat it), and once per attempt under plain torchrun (the first
rank of the attempt), with none of the library's frames in any traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.agents import FAST_RDZV_CONF

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
SENTENCE = "steps but is not part of the saved state"
LATE_OPTIMIZER = """
import torch
from torch import nn
from elastic_trainer import Elastic

torch.manual_seed(0)
model = nn.Linear(4, 2)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
elastic = Elastic(model, data, global_batch_size=8, max_steps=5, checkpoint_dir="ckpt")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # after Elastic: not saved
for step in elastic:
    with step:
        for x, y in step:
            step.backward(nn.functional.cross_entropy(elastic.ddp(x), y) * step.weight)
        optimizer.step()
        optimizer.zero_grad()
"""


def _run(tmp: Path, launcher: list[str]) -> tuple[int, str]:
    (tmp / "late.py").write_text(LATE_OPTIMIZER)
    done = subprocess.run(
        [sys.executable, "-m", *launcher, "late.py"],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )
    return done.returncode, done.stdout + done.stderr


def _no_library_frames(output: str) -> None:
    frames = [line for line in output.splitlines() if line.strip().startswith('File "')]
    assert not [f for f in frames if "/elastic_trainer/" in f], output[-3000:]


def test_under_elastic_trainer_run_the_mistake_is_one_line(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    code, output = _run(
        tmp_path,
        ["elastic_trainer.cli", "run", "--rdzv-endpoint", etcd_server.endpoint, "--run-id",
         unique_id, "--nproc-per-node", "2", "--metrics-port", "0", "--rdzv-conf", FAST_RDZV_CONF],
    )  # fmt: skip
    assert code == 2, output[-3000:]
    said = [line for line in output.splitlines() if SENTENCE in line]
    assert len(said) == 1 and said[0].startswith("elastic-trainer: job failed: rank"), said
    assert "failed (exitcode:" not in output, "torch's agent does not say it again"
    _no_library_frames(output)


def test_under_plain_torchrun_each_attempt_says_it_once(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    code, output = _run(
        tmp_path,
        ["torch.distributed.run", "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={etcd_server.endpoint}",
         f"--rdzv-id={unique_id}", f"--rdzv-conf={FAST_RDZV_CONF}", "--nnodes=1",
         "--nproc-per-node=2", "--max-restarts=1"],
    )  # fmt: skip
    assert code != 0, output[-3000:]
    ours = [line for line in output.splitlines() if SENTENCE in line and "elastic_trainer" in line]
    assert len(ours) == 2, ours  # two attempts, one line each
    assert all(line.startswith("elastic_trainer: error: ") for line in ours), ours
    _no_library_frames(output)
