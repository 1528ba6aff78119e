"""The own-loop API in one process (world of one, gloo): a plain loop with gradient accumulation
on ``Elastic``, exact resume, ``max_steps`` alone, the traps refused in one line (an optimizer
created after ``Elastic``, a DistributedSampler) and the progress lines of a script that
configures no logging. Multi-rank healing is in tests/integration/test_own_loop.py and
test_readme_own_loop.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from elastic_trainer import Elastic, ElasticLoop, TrainingState
from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.checkpoint.manager import CheckpointManager
from elastic_trainer.runtime import failures
from elastic_trainer.runtime.distributed import DistEnv

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def _data(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def _train(
    directory: Path | None,
    *,
    max_steps: int | None,
    epochs: int | None = None,
    late_optimizer: bool = False,
    checkpoint_every: int = 4,
    log_every: int = 1000,
) -> tuple[Elastic, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    elastic = Elastic(
        model,
        _data(),
        global_batch_size=8,
        micro_batch_size=2,
        max_steps=max_steps,
        epochs=epochs,
        checkpoint_dir=None if directory is None else str(directory),
        checkpoint_every=checkpoint_every,
        log_every=log_every,
    )
    if late_optimizer:  # created after Elastic looked: not saved
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in elastic:
        with step:
            for x, y in step:
                step.backward(nn.functional.cross_entropy(elastic.ddp(x), y) * step.weight)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return elastic, model


def test_max_steps_alone_runs_past_the_first_epoch_and_resume_is_bitwise(tmp_path: Path) -> None:
    elastic, model = _train(tmp_path / "a", max_steps=12)  # 5 steps an epoch
    assert (
        elastic.result is not None and elastic.result.step == 12 and elastic.result.exit_code == 0
    )
    assert set(elastic.state.objects) == {"model", "optimizer", "scheduler", "sampler"}, (
        "found, not listed"
    )
    assert ckpt.iter_checkpoints(tmp_path / "a") == [4, 8, 12]

    resumed = tmp_path / "b"
    resumed.mkdir()
    for name in (
        ckpt.checkpoint_path(tmp_path / "a", 8).name,
        ckpt.manifest_path(tmp_path / "a", 8).name,
    ):
        shutil.copy(tmp_path / "a" / name, resumed / name)
    again, model_again = _train(resumed, max_steps=12)
    assert again.result is not None and again.result.resumed_from == 8 and again.result.step == 12
    for (name, a), (_, b) in zip(
        model.state_dict().items(), model_again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_epochs_bound_the_run_when_both_are_given() -> None:
    elastic, _ = _train(None, max_steps=12, epochs=1)
    assert elastic.result is not None and elastic.result.step == 5


def test_an_optimizer_created_after_elastic_is_refused_at_the_first_step_with_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        _train(None, max_steps=3, late_optimizer=True)
    assert exited.value.code == failures.EXIT_DETERMINISTIC
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "optimizer (SGD) over the model's parameters steps but is not part of the saved state"
        in err[0]
    ), err


def test_a_distributed_sampler_is_refused_before_the_first_step_naming_elastic_sampler(
    gloo_world: None,
) -> None:
    model = nn.Linear(2, 2)
    env = DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        restart_count=0,
        launched=False,
        device=torch.device("cpu"),
        backend="gloo",
    )
    sampler: Any = DistributedSampler(_data(), num_replicas=1, rank=0)
    manager = CheckpointManager(
        CheckpointConfig(), env=env, state=TrainingState({"model": model}, env=env), fingerprint={}
    )
    with pytest.raises(
        failures.ConfigError, match="DistributedSampler, not an elastic one"
    ) as refused:
        ElasticLoop(env=env, sampler=sampler, checkpoints=manager, max_steps=3)
    assert "ElasticSampler(len(dataset), global_batch_size" in str(
        refused.value
    ) and "\n" not in str(refused.value)
    assert failures.classify(refused.value)[0] is failures.FailureClass.DETERMINISTIC, (
        "exit 2: no restart spent"
    )


SCRIPT = """
from pathlib import Path
from tests.unit.test_own_loop_api import _train  # the same loop, in a fresh interpreter: no logging set up
_train(Path({directory!r}), max_steps=6, checkpoint_every=3, log_every=2)
"""


def test_progress_checkpoint_and_finished_lines_appear_with_no_logging_configured(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(directory=str(tmp_path / "ckpt"))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    for line in (
        "starting from scratch",
        "step 2 epoch 0 loss",
        "checkpoint of step 3 written",
        "training finished at step 6",
    ):
        assert line in done.stderr, f"{line!r} missing:\n{done.stderr}"


def test_tokens_are_counted_from_token_id_batches_without_tokens_per_sample() -> None:
    """Issue 40 item 6: a batch of token ids (integers, a row a sample) counts its tokens for
    ``tokens_total`` without ``tokens_per_sample``; features count none."""
    from elastic_trainer.train.elastic import tokens_per_sample_of

    ids = torch.randint(0, 64, (4, 32))
    assert tokens_per_sample_of((ids, ids)) == 32
    assert tokens_per_sample_of({"input_ids": ids.view(4, 8, 4)}) == 32
    assert tokens_per_sample_of((torch.randn(4, 32), ids[:, 0])) == 0
    assert tokens_per_sample_of(ids[:, 0]) == 0  # labels alone: one value a sample
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 8), nn.Flatten(), nn.Linear(8 * 32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randint(0, 64, (16, 32)), torch.randint(0, 2, (16,)))
    elastic = Elastic(model, data, global_batch_size=4, max_steps=2, log_every=1000)
    for step in elastic:
        with step:
            for x, y in step:
                step.backward(nn.functional.cross_entropy(elastic.ddp(x), y) * step.weight)
            optimizer.step()
            optimizer.zero_grad()
    assert elastic.loop is not None and elastic.loop.tokens_per_sample == 32
