"""Elastic says in one line, at start, when a run under ``elastic-trainer run`` cannot heal in
place, and what to write instead: the process group existed before it (``fully_shard`` and
``init_device_mesh`` create the default group themselves), or a sharded model has no
``rebuild=``. One real gloo process (world of one) with a model sharded by ``fully_shard``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_trainer import Elastic
from elastic_trainer.runtime.settings import HealSettings, WorkerSettings
from elastic_trainer.train.elastic import healing_advice
from tests.support.dist_env import cpu_env

pytestmark = pytest.mark.timeout(120)


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "healing in place is off" in r.getMessage()]


@pytest.mark.parametrize("launched", [True, False])
def test_a_model_sharded_before_elastic_warns_once_that_it_does_not_heal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, launched: bool
) -> None:
    from torch.distributed.fsdp import fully_shard

    # The user's natural code: shard first (the default group then exists), then Elastic.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        fully_shard(model[0])
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        elastic = Elastic(
            model,
            16,
            global_batch_size=4,
            max_steps=2,
            rebuild=lambda env: {"model": model, "optimizer": optimizer},
            settings=WorkerSettings(heal=HealSettings(enabled=True, endpoint="127.0.0.1:1")),
            env=cpu_env(launched=launched),
        )
        caplog.set_level(logging.WARNING, logger="elastic_trainer.train.elastic")
        for step in elastic:
            with step:
                for micro in step:
                    step.backward(
                        elastic.module(torch.ones(len(micro.indices), 4)).sum() * step.weight
                    )
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        assert elastic.result is not None and elastic.result.step == 2, "it still trains"
    finally:
        dist.destroy_process_group()
    lines = _lines(caplog)
    if not launched:  # not under elastic-trainer run: nothing would heal anyway, nothing to say
        assert lines == []
        return
    assert len(lines) == 1, lines
    assert "existed before Elastic (fully_shard and init_device_mesh create it)" in lines[0]
    assert "with ElasticGroup() as group:" in lines[0]
    assert "Elastic(..., group=group, rebuild=...)" in lines[0]
    assert "\n" not in lines[0]


def test_the_advice_for_each_case() -> None:
    kw = {"heal_on": True, "group_heals": True, "own_group": True}
    assert healing_advice(**kw, sharded=True, rebuild=True) is None  # the recipe: heals
    assert healing_advice(**kw, sharded=False, rebuild=False) is None  # DDP: heals
    no_rebuild = healing_advice(**kw, sharded=True, rebuild=False)
    assert no_rebuild is not None and "has no rebuild=" in no_rebuild
    replicated = healing_advice(
        heal_on=True, group_heals=False, own_group=True, sharded=False, rebuild=False
    )
    assert replicated is not None and "init_process_group was called" in replicated
    entered = healing_advice(
        heal_on=True, group_heals=False, own_group=False, sharded=True, rebuild=True
    )
    assert entered is not None and "existed before ElasticGroup was entered" in entered
    assert (
        healing_advice(
            heal_on=False, group_heals=False, own_group=True, sharded=True, rebuild=False
        )
        is None
    )
