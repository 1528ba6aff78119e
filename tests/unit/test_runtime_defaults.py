"""What a user's own script gets from `Trainer` without configuring anything: progress lines on
stderr, and metrics wherever the launcher collects them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from elastic_trainer.train.config import TrainerConfig
from elastic_trainer.train.trainer import Trainer, TrainingJob

def data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(128, 4, generator=g), torch.randint(0, 2, (128,), generator=g))

job = TrainingJob(model=lambda: nn.Linear(4, 2), dataset=data, loss=nn.functional.cross_entropy,
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
trainer = Trainer(TrainerConfig(global_batch_size=8, max_steps=12, log_every=5), job)
trainer.fit()
print("observer", type(trainer.observer).__name__)
"""


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **{
                k: v
                for k, v in os.environ.items()
                if not k.startswith("ELASTIC_TRAINER") and k != "PROMETHEUS_MULTIPROC_DIR"
            },
            "OMP_NUM_THREADS": "1",
            **env,
        },
    )


def test_progress_lines_without_any_logging_setup() -> None:
    done = _run({})
    assert done.returncode == 0, done.stderr
    progress = [
        line
        for line in done.stderr.splitlines()
        if "[rank 0] INFO elastic_trainer.train.loop: step" in line
    ]
    assert [line.split(": ", 1)[1].split(" epoch")[0] for line in progress] == [
        "step 5",
        "step 10",
    ], done.stderr
    assert "no checkpoint_dir: this job is not fault tolerant" in done.stderr
    assert "observer NullObserver" in done.stdout, "no launcher collecting metrics: none"


def test_metrics_by_default_under_the_launchers_environment(tmp_path: Path) -> None:
    done = _run({"ELASTIC_TRAINER_METRICS": "1", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "observer PrometheusObserver" in done.stdout
    assert any(p.name.startswith("counter_") for p in tmp_path.iterdir()), (
        "the worker wrote its samples"
    )
