"""Global-batch invariance under torchrun: the same job on 1 rank and on 3 ranks (uneven shares,
gradient accumulation with ``no_sync``, a short tail step with padding) computes the same steps,
up to floating-point summation order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_trainer.examples.synthetic_cnn import SmallCNN
from tests.support.agents import agents, start_agent
from tests.support.records import final_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_one_rank_and_three_ranks_train_the_same_model(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    # 110 samples, 20 per step: 5 full steps (3 ranks: 7 + 7 + 6) and a tail of 10 (4 + 3 + 3);
    # with micro-batches of at most 2, every rank runs 4 forwards per full step, padding included.
    common = [
        "--dataset-size",
        "110",
        "--global-batch-size",
        "20",
        "--epochs",
        "2",
        "--seed",
        "21",
        "--no-batchnorm",
        "--lr",
        "0.1",
    ]
    with agents() as started:
        one = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=f"{unique_id}-1",
            nproc_per_node=1,
            log_path=tmp_path / "one.log",
            job_args=[*common, "--checkpoint-dir", str(tmp_path / "one")],
        )
        three = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=f"{unique_id}-3",
            nproc_per_node=3,
            log_path=tmp_path / "three.log",
            job_args=[
                *common,
                "--micro-batch-size",
                "2",
                "--checkpoint-dir",
                str(tmp_path / "three"),
            ],
        )
        started += [one, three]
        assert one.wait(150) == 0, one.tail()
        assert three.wait(150) == 0, three.tail()
    step_one, model_one = final_model(tmp_path / "one")
    step_three, model_three = final_model(tmp_path / "three")
    assert step_one == step_three == 12
    torch.manual_seed(21)  # the initial weights, as the runtime seeds them
    initial = SmallCNN(16, batchnorm=False).state_dict()
    for name, value in model_one.items():
        moved = (value - initial[name]).abs().max().item()
        differs = (model_three[name] - value).abs().max().item()
        assert moved > 1e-3, f"{name} hardly trained; the comparison would prove nothing"
        assert differs < 1e-6 + 1e-4 * moved, (
            f"{name}: 1 vs 3 ranks differ by {differs}, training moved it {moved}"
        )
