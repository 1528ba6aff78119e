"""On a real GPU: steady-state steps of the runtime with every default on never synchronise the host
with the device, checked by torch itself (``torch.cuda.set_sync_debug_mode("error")`` raises on any
synchronising call). A decoder-shaped model without BatchNorm buffers (the exception documented in
``docs/design/steady-state.md``), NCCL, one rank per GPU; metrics through the real observer,
asynchronous checkpoints every 10 steps staged into pinned buffers. The control repeats the run
with one ``.item()`` in the loss and expects torch to raise.

Marker ``gpu``: CI has no GPU and deselects these; run with ``bash scripts/test.sh tests/gpu -m gpu``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]

WORKER = r"""
import os, sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3],
                  ELASTIC_TRAINER_METRICS="1", TORCHELASTIC_RUN_ID="sync-gpu")
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.train.config import TrainerConfig
from elastic_trainer.train.trainer import Trainer, TrainingJob

leak = sys.argv[2] == "1"

class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 256)
        self.layers = nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 4)
        self.head = nn.Linear(256, 512)
    def forward(self, tokens):
        return self.head(self.layers(self.embed(tokens)))

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 512, (4096, 64), generator=g)
    return TensorDataset(x, torch.roll(x, -1, 1))

def loss(output, target):
    value = nn.functional.cross_entropy(output.reshape(-1, 512), target.reshape(-1))
    if leak:
        value.item()
    return value

class Window:
    def __call__(self, trainer, step):
        torch.cuda.set_sync_debug_mode("error" if 6 <= step < 26 else "default")

job = TrainingJob(model=Decoder, dataset=data, loss=loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
config = TrainerConfig(global_batch_size=32, max_steps=30, log_every=1,
                       checkpoint=CheckpointConfig(directory=sys.argv[1], every=10))
trainer = Trainer(config, job, callbacks=[Window()])
trainer.fit()
print("steady state without a device wait", flush=True)
"""


def _run(tmp_path: Path, *, leak: bool) -> subprocess.CompletedProcess[str]:
    from rendezvous.etcd_server import free_port

    metrics = tmp_path / f"metrics-{int(leak)}"
    metrics.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics)}
    return subprocess.run(
        [
            sys.executable,
            "-c",
            WORKER,
            str(tmp_path / f"ckpt-{int(leak)}"),
            str(int(leak)),
            str(free_port()),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )


def test_steady_state_steps_never_synchronise_with_the_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (gpu marker)")
    done = _run(tmp_path, leak=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "steady state without a device wait" in done.stdout
    control = _run(tmp_path, leak=True)
    assert control.returncode != 0 and "synchroniz" in control.stderr.lower(), control.stderr[
        -3000:
    ]
