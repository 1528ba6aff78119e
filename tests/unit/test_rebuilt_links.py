"""A scheduler built once, outside ``rebuild``, follows the optimizer a heal's rebuild put in its
place (a new user's FSDP2 port froze its learning rate after a heal and drifted from the fault-free
run without a word); other kept objects that hold a replaced one are named."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.state import rebuilt_links
from elastic_trainer.state.training_state import TrainingState
from tests.support.dist_env import cpu_env


def _cosine(step: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * min(step, 20) / 20))


def _build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, steps: int) -> None:
    for _ in range(steps):
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    rebuilt_links._warned.clear()


def test_a_kept_scheduler_drives_the_rebuilt_optimizer_as_one_built_on_it(caplog) -> None:
    model, optimizer = _build()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _cosine)
    state = TrainingState(
        {"model": model, "optimizer": optimizer, "scheduler": scheduler}, env=cpu_env()
    )
    _train(model, optimizer, scheduler, 5)
    saved = copy.deepcopy({k: v.state_dict() for k, v in state.objects.items()})

    # The reference: everything built anew and loaded from the same state (a fault-free twin).
    twin_model, twin_optimizer = _build(1)
    twin_scheduler = torch.optim.lr_scheduler.LambdaLR(twin_optimizer, _cosine)
    for obj, name in ((twin_model, "model"), (twin_optimizer, "optimizer")):
        obj.load_state_dict(saved[name])
    twin_scheduler.load_state_dict(saved["scheduler"])

    # The heal: rebuild returns the model and the optimizer only; their state is loaded after.
    new_model, new_optimizer = _build(2)
    with caplog.at_level(logging.WARNING, logger=rebuilt_links.__name__):
        state.replace({"model": new_model, "optimizer": new_optimizer})
    new_model.load_state_dict(saved["model"])
    new_optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))  # no shared moments

    assert scheduler.optimizer is new_optimizer
    _train(new_model, new_optimizer, scheduler, 6)
    _train(twin_model, twin_optimizer, twin_scheduler, 6)
    assert [g["lr"] for g in new_optimizer.param_groups] == [
        g["lr"] for g in twin_optimizer.param_groups
    ]
    assert new_optimizer.param_groups[0]["lr"] != optimizer.param_groups[0]["lr"]  # old one frozen
    for mine, theirs in zip(new_model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "'scheduler'" in lines[0] and "rebuild" in lines[0], lines

    # A second heal warns no more (the same object, the same advice).
    caplog.clear()
    again_model, again_optimizer = _build(3)
    with caplog.at_level(logging.WARNING, logger=rebuilt_links.__name__):
        state.replace({"model": again_model, "optimizer": again_optimizer})
    assert scheduler.optimizer is again_optimizer and not caplog.records


def test_chained_schedulers_follow_and_a_returned_scheduler_is_left_alone() -> None:
    model, optimizer = _build()
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    decay = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    chained = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[3])
    state = TrainingState({"model": model, "optimizer": optimizer, "sched": chained}, env=cpu_env())
    new_model, new_optimizer = _build(1)
    state.replace({"model": new_model, "optimizer": new_optimizer})
    assert chained.optimizer is new_optimizer
    assert warmup.optimizer is new_optimizer and decay.optimizer is new_optimizer

    returned = torch.optim.lr_scheduler.LambdaLR(new_optimizer, _cosine)
    again_model, again_optimizer = _build(2)
    own = torch.optim.lr_scheduler.LambdaLR(again_optimizer, _cosine)
    state.replace({"model": again_model, "optimizer": again_optimizer, "sched": own})
    assert state.objects["sched"] is own and own.optimizer is again_optimizer
    assert returned.optimizer is new_optimizer  # not ours: never touched


class _Ema:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_another_kept_object_holding_a_replaced_one_is_named(caplog) -> None:
    model, optimizer = _build()
    state = TrainingState(
        {"model": model, "optimizer": optimizer, "ema": _Ema(model)}, env=cpu_env()
    )
    new_model, new_optimizer = _build(1)
    with caplog.at_level(logging.WARNING, logger=rebuilt_links.__name__):
        found = rebuilt_links.follow_rebuild(
            {**state.objects, "model": new_model, "optimizer": new_optimizer},
            {"model": model, "optimizer": optimizer},
            {"model": new_model, "optimizer": new_optimizer},
        )
    assert found == ["ema"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "'ema' still holds model ('model')" in line and "rebuild" in line


def test_a_scheduler_whose_optimizer_became_no_optimizer_is_refused_in_one_line() -> None:
    model, optimizer = _build()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _cosine)
    state = TrainingState(
        {"model": model, "optimizer": optimizer, "scheduler": scheduler}, env=cpu_env()
    )
    with pytest.raises(ConfigError, match="'scheduler' schedules 'optimizer'.*not an optimizer"):
        state.replace({"optimizer": nn.Linear(1, 1)})


def test_a_kept_optimizer_of_the_replaced_model_is_refused_in_one_line() -> None:
    """An optimizer built once, outside build(), and found by the run: after a heal rebuild
    returns the model alone, and the optimizer would step the old model's parameters (before: a
    bare KeyError of a parameter id at the restore, a new user's trial)."""
    model, optimizer = _build()
    state = TrainingState({"model": model, "optimizer": optimizer}, env=cpu_env())
    new_model, _ = _build(1)
    with pytest.raises(ConfigError, match="rebuild did not return 'optimizer', which steps the "
                       "parameters of 'model'.*return it under that name") as refused:  # fmt: skip
        state.replace({"model": new_model})
    assert "\n" not in str(refused.value)


def test_a_kept_optimizer_of_a_model_that_stays_is_left_alone() -> None:
    model, optimizer = _build()
    head = nn.Linear(2, 2)
    head_optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    state = TrainingState(
        {"model": model, "optimizer": optimizer, "head_optimizer": head_optimizer}, env=cpu_env()
    )
    new_model, new_optimizer = _build(1)
    state.replace({"model": new_model, "optimizer": new_optimizer})
    assert state.objects["head_optimizer"] is head_optimizer
