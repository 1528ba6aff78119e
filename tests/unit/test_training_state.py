"""The training state's own checks: what it finds, the unsaved optimizer refused at its first step,
the replica check after a heal (two real gloo processes), and the resume line's claim."""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.checkpoint.manager import CheckpointManager
from elastic_trainer.runtime.settings import WorkerSettings
from elastic_trainer.state.training_state import (
    ReplicaMismatchError,
    TrainingState,
    UnsavedStateError,
    find_states,
)
from tests.support.dist_env import cpu_env

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 2)


def test_optimizers_and_schedulers_are_found_and_named_by_parameter_place_not_creation_order() -> (
    None
):
    model = Net()
    head = torch.optim.AdamW(model.head.parameters())  # created first, over the later parameters
    embedding = torch.optim.SGD(model.embedding.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(head, step_size=2)
    other = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)  # not over this model: not ours
    scaler = object()
    found = find_states(model, scaler=scaler)
    assert found == {
        "optimizer": embedding,
        "optimizer_1": head,
        "scheduler": schedule,
        "scaler": scaler,
    }
    assert other not in found.values()


def test_an_optimizer_over_the_model_that_is_not_saved_is_refused_before_its_first_step() -> None:
    model = Net()
    saved = torch.optim.SGD(model.head.parameters(), lr=0.1)
    forgotten = torch.optim.AdamW(model.embedding.parameters(), lr=0.1)
    state = TrainingState({"model": model, "optimizer": saved}, env=cpu_env())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = model.embedding.weight.detach().clone()
    with state.watch():
        saved.step()  # saved: fine
        with pytest.raises(
            UnsavedStateError,
            match="optimizer \\(AdamW\\) over the model's parameters steps but is not part of",
        ) as e:
            forgotten.step()
    assert "\n" not in str(e.value), "one line"
    assert torch.equal(model.embedding.weight, before), "refused before it changed anything"
    forgotten.step()  # outside the elastic loop nothing is watched


def _replica_worker(rank: int, store_path: str, lossy: bool, results: Any) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        counter = _Counter(
            rank if lossy else 0
        )  # a load_state_dict that does not restore what it saved
        state = TrainingState({"model": model, "counter": counter}, env=cpu_env(rank, 2), seed=0)
        try:
            state.verify_replicas()
            results.put((rank, "equal", state.consistent))
        except ReplicaMismatchError as exc:
            results.put((rank, str(exc), state.consistent))
    finally:
        dist.destroy_process_group()


class _Counter:
    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


@pytest.mark.parametrize("lossy", [False, True])
def test_replicas_are_compared_once_after_a_heal_and_a_difference_names_the_state(
    tmp_path: Path, lossy: bool
) -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [
        context.Process(
            target=_replica_worker, args=(rank, str(tmp_path / "store"), lossy, results)
        )
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        seen = sorted(results.get(timeout=90) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
    if not lossy:
        assert seen == [(0, "equal", True), (1, "equal", True)]
        return
    for _, message, consistent in seen:
        assert (
            "different 'counter' states" in message
            and "falling back to the newest checkpoint" in message
        )
        assert "\n" not in message
        assert consistent is False, "a differing state is never saved (no just-in-time save of it)"


def _manager(directory: Path, states: dict[str, Any]) -> CheckpointManager:
    model = states["model"]
    return CheckpointManager(
        CheckpointConfig(directory=str(directory), every=1, async_write=False),
        env=cpu_env(),
        states=states,
        fingerprint={"model": ckpt.model_signature(model.state_dict())},
        settings=WorkerSettings(),
    )


def test_the_resume_line_claims_bitwise_only_for_what_was_restored(
    tmp_path: Path, gloo_world: None, caplog: pytest.LogCaptureFixture
) -> None:
    model = nn.Linear(3, 2)
    writer = _manager(tmp_path, {"model": model})  # saved without its optimizer
    writer.state.step = 3
    writer.save(3, final=True)
    writer.close(1.0)

    caplog.set_level(logging.INFO, logger="elastic_trainer")
    optimizer = torch.optim.AdamW(model.parameters())
    reader = _manager(tmp_path, {"model": model, "optimizer": optimizer})
    assert reader.load() == 3
    reader.close(1.0)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from"))
    assert "NOT an exact resume" in line and "'optimizer'" in line and "bitwise" not in line, line

    caplog.clear()
    complete = _manager(tmp_path, {"model": model})
    complete.load()
    complete.close(1.0)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from"))
    assert "exact resume" in line and "NOT" not in line, line
