"""A steady-state step never waits for the device: counted on CPU.

Two real gloo ranks train with every default on (metrics through the real worker observer and its
sampled allreduce timing, the just-in-time save with BatchNorm buffers, asynchronous checkpoints every
10 steps, a progress line every step). Between steps 6 and 26 every call that would make the host
wait for a GPU is counted: ``Tensor.item``/``tolist``/``numpy``/``cpu``, a ``to``/``copy_`` that
moves data to the host without ``non_blocking``, ``float``/``int``/``bool`` of a tensor, and CUDA
stream/event/device synchronisation. There must be none. (On CPU these calls are cheap; on a GPU
each one would stall the host until the queued step finished. tests/gpu runs the same loop under
``torch.cuda.set_sync_debug_mode("error")``.) Reads that torch itself keeps on the host on a GPU
(AdamW's step counters) are not counted (``HOST_SIDE``). A control run with a deliberate ``.item()`` in the
loss proves the counter sees such calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_trainer.ops.processes import wait_for

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]

WORKER = r"""
import collections, json, os, sys, traceback
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

rank, world, out, store, leak = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3], sys.argv[4] == "1"
os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), ELASTIC_TRAINER_METRICS="1",
                  TORCHELASTIC_RUN_ID="sync-test")
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.runtime.distributed import read_env
from elastic_trainer.train.config import TrainerConfig
from elastic_trainer.train.trainer import Trainer, TrainingJob

counts = collections.Counter()
where = collections.Counter()
state = {"counting": False}

# torch keeps these on the host even when training on a GPU (not device reads): the optimizers'
# step counters (torch/optim: `_get_value(step)`, state_steps live on the CPU unless capturable).
HOST_SIDE = (("torch/optim/optimizer.py", "_get_value"),)

def counted(name, original, blocking=lambda *a, **k: True):
    def wrapper(*args, **kwargs):
        if state["counting"] and blocking(*args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            if not any(caller.filename.endswith(f) and caller.name == fn for f, fn in HOST_SIDE):
                counts[name] += 1
                where[f"{name} in {caller.name} at {caller.filename.rsplit('/', 3)[-1]}:{caller.lineno}"] += 1
        return original(*args, **kwargs)
    return wrapper

def to_host(self, *args, **kwargs):  # Tensor.to(...) onto the CPU without non_blocking
    target = kwargs.get("device", args[0] if args and not isinstance(args[0], torch.dtype) else None)
    return target is not None and str(target).startswith("cpu") and not kwargs.get("non_blocking", False)

def copy_to_host(self, src, non_blocking=False):
    return self.device.type == "cpu" and src.device.type != "cpu" and not non_blocking

T = torch.Tensor
for name in ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__"):
    setattr(T, name, counted(name, getattr(T, name)))
T.to = counted("to(cpu)", T.to, to_host)
T.copy_ = counted("copy_(to host, blocking)", T.copy_, copy_to_host)
torch.cuda.synchronize = counted("cuda.synchronize", torch.cuda.synchronize)
torch.cuda.Stream.synchronize = counted("Stream.synchronize", torch.cuda.Stream.synchronize)
torch.cuda.Event.synchronize = counted("Event.synchronize", torch.cuda.Event.synchronize)

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 8, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())

def loss(output, target):
    value = nn.functional.cross_entropy(output, target)
    if leak:
        value.item()  # the control: a loss that reads itself back every step
    return value

class Window:  # counts between the boundaries of steps 6 and 26
    def __init__(self):
        self.step = 0
    def __call__(self, trainer, step):
        state["counting"] = 6 <= step < 26

dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
job = TrainingJob(model=lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1),
                                            nn.Linear(16, 2)),
                  dataset=data, loss=loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                  scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5))
config = TrainerConfig(global_batch_size=16, max_steps=30, checkpoint=CheckpointConfig(directory=out + "/ckpt",
                       every=10), log_every=1)
trainer = Trainer(config, job, env=read_env(cuda_devices=0), callbacks=[Window()])
trainer.fit()
state["counting"] = False
dist.destroy_process_group()
assert type(trainer.observer).__name__ == "PrometheusObserver", trainer.observer
assert trainer.checkpoints.just_in_time.enabled and trainer.checkpoints.state.buffers is not None
with open(f"{out}/counts-{rank}.json", "w") as f:
    json.dump({"counts": dict(counts), "where": dict(where)}, f)
from elastic_trainer.runtime.process_exit import exit_process
exit_process(0)  # torch 2.13's gloo can abort in interpreter teardown after a clean destroy (CI saw -6)
"""


def _run(tmp_path: Path, *, leak: bool) -> list[dict]:
    out = tmp_path / ("leak" if leak else "clean")
    metrics = out / "metrics"
    metrics.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROMETHEUS_MULTIPROC_DIR": str(metrics)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(rank), str(out), str(out / "store"), str(int(leak))],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    wait_for(
        lambda: all((out / f"counts-{r}.json").exists() for r in range(2)),
        timeout=5,
        what="the counts",
    )
    return [json.loads((out / f"counts-{r}.json").read_text()) for r in range(2)]


def test_a_steady_state_step_never_waits_for_the_device(tmp_path: Path) -> None:
    for rank, result in enumerate(_run(tmp_path, leak=False)):
        assert result["counts"] == {}, (
            f"rank {rank}: calls that would wait for a GPU: {result['where']}"
        )


def test_the_counter_sees_a_read_back_loss(tmp_path: Path) -> None:
    """The control: the same loop with one ``.item()`` per step is caught, at the line it is on."""
    for result in _run(tmp_path, leak=True):
        assert result["counts"].get("item", 0) >= 20, result
