"""The Trainer's just-in-time save, in process (one rank, gloo): a snapshot taken in the middle of
a step (after BatchNorm changed its statistics) is exactly the regular checkpoint of the last
completed step, resuming from it is bitwise equal to an uninterrupted run, a failing training
loop saves before it raises, and ZeRO turns JIT off with a reason."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint.jit import SAVE_TIMEOUT_S
from elastic_trainer.runtime import rng
from elastic_trainer.train.config import TrainerConfig
from elastic_trainer.train.trainer import Trainer, TrainingJob
from tests.support.configs import trainer_config

pytestmark = pytest.mark.timeout(120)

STEPS, SAVE_AT = 9, 5  # 48 samples / 8 per step: 6 steps an epoch, so the run crosses an epoch


class Probe(nn.Module):
    """Identity that calls ``action`` during the forward number ``at`` (0-based)."""

    def __init__(self, at: int, action: list[Any]) -> None:
        super().__init__()
        self.calls, self.at, self.action = 0, at, action

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls == self.at and self.action:
            self.action[0]()
        self.calls += 1
        return x


def _job(action: list[Any] | None = None, at: int = -1) -> TrainingJob:
    def data() -> TensorDataset:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(48, 6, generator=g)
        return TensorDataset(x, (x.sum(1) > 0).long())

    return TrainingJob(
        # BatchNorm before the probe: by the time the probe runs, this step's forward has already
        # changed the running statistics; the JIT snapshot must not contain that change.
        model=lambda: nn.Sequential(
            nn.Linear(6, 12),
            nn.BatchNorm1d(12),
            Probe(at, action or []),
            nn.ReLU(),
            nn.Linear(12, 2),
        ),
        dataset=data,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.7),
        loss=nn.CrossEntropyLoss(),
    )


def _config(directory: Path, **overrides: Any) -> TrainerConfig:
    values: dict[str, Any] = {
        "global_batch_size": 8,
        "max_steps": STEPS,
        "epochs": 3,
        "log_every": 1000,
        "checkpoint_dir": str(directory),
        "checkpoint_every": 1000,
        "jit_save": True,
    }
    values.update(overrides)
    return trainer_config(**values)


def _assert_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _jit_mid_step(directory: Path) -> tuple[Trainer, Any]:
    """Run to STEPS; during the forward of step SAVE_AT + 1 a thread saves just in time while the
    main thread waits for it (as if blocked in a collective)."""
    holder: dict[str, Any] = {}

    def save_from_another_thread() -> None:
        trainer: Trainer = holder["trainer"]
        thread = threading.Thread(
            target=lambda: holder.setdefault(
                "outcome",
                trainer.checkpoints.just_in_time.save(
                    "test", deadline=time.monotonic() + SAVE_TIMEOUT_S
                ),
            )
        )
        thread.start()
        thread.join(30)

    trainer = Trainer(_config(directory), _job([save_from_another_thread], at=SAVE_AT))
    holder["trainer"] = trainer
    trainer.fit()
    return trainer, holder["outcome"]


def test_a_mid_step_snapshot_is_exactly_the_checkpoint_of_the_last_completed_step(
    tmp_path: Path,
) -> None:
    _, outcome = _jit_mid_step(tmp_path / "jit")
    assert outcome.saved and outcome.step == SAVE_AT
    reference = Trainer(_config(tmp_path / "ref", checkpoint_every=SAVE_AT), _job())
    reference.fit()
    jit_info = ckpt.verify(tmp_path / "jit", SAVE_AT)
    ref_info = ckpt.verify(tmp_path / "ref", SAVE_AT)
    assert jit_info.manifest.jit and not ref_info.manifest.jit
    jit_state = torch.load(jit_info.path, weights_only=True)
    ref_state = torch.load(ref_info.path, weights_only=True)
    assert (
        jit_state["jit"] == {"writer_rank": 0, "buffers": "rank0"}
        and jit_state["rng"]["scheme"] == rng.STEP_SCHEME
    )
    for key in (
        "model",
        "optimizer",
        "scheduler",
        "sampler",
        "step",
        "epoch",
        "world_size",
        "fingerprint",
    ):
        _assert_equal(jit_state[key], ref_state[key], key)
    assert int(jit_state["model"]["1.num_batches_tracked"]) == SAVE_AT, (
        "BatchNorm statistics of step 5, not 6"
    )


def test_resuming_from_a_jit_checkpoint_is_bitwise_equal_to_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    _jit_mid_step(tmp_path / "jit")
    for step in ckpt.iter_checkpoints(
        tmp_path / "jit"
    ):  # the crash: only the JIT checkpoint is left
        if step != SAVE_AT:
            ckpt.checkpoint_path(tmp_path / "jit", step).unlink()
            ckpt.manifest_path(tmp_path / "jit", step).unlink()
    resumed = Trainer(_config(tmp_path / "jit"), _job())
    result = resumed.fit()
    straight = Trainer(_config(tmp_path / "straight"), _job())
    expected = straight.fit()
    assert result.resumed_from == SAVE_AT and result.step == expected.step == STEPS
    _assert_equal(
        torch.load(result.checkpoint, weights_only=True)["model"],
        torch.load(expected.checkpoint, weights_only=True)["model"],
        "model",
    )


class FailingObserver:
    """Raises what gloo raises when a peer died, when step ``at`` is reported."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step(self, **kw: Any) -> None:
        if kw["step"] == self.at:
            raise RuntimeError(
                "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242"
            )

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("jit", [True, False])
def test_a_failing_training_loop_saves_the_last_completed_step_before_raising(
    tmp_path: Path, jit: bool
) -> None:
    trainer = Trainer(_config(tmp_path, jit_save=jit), _job(), observer=FailingObserver(at=3))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        trainer.fit()
    # Step 3 is reported at the end of step 5 (its loss rides on step 4's control, read after
    # step 5), whose update is complete: step 5 is the last one.
    assert trainer.step == 5
    if jit:
        assert ckpt.iter_checkpoints(tmp_path) == [5] and ckpt.verify(tmp_path, 5).manifest.jit
    else:
        assert ckpt.iter_checkpoints(tmp_path) == [], (
            "without JIT nothing is saved: the test can fail"
        )
    for thread in threading.enumerate():
        if thread.name == "jit-deadline":
            thread.join(2)  # a cancelled timer ends at once; one still armed would not
            assert not thread.is_alive(), "the exit deadline is disarmed once fit() is done"


def test_zero_redundancy_turns_jit_off_with_a_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="elastic_trainer.checkpoint.manager"):
        trainer = Trainer(
            _config(tmp_path, zero_redundancy=True), _job(), observer=FailingObserver(at=3)
        )
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            trainer.fit()
    assert not trainer.checkpoints.just_in_time.enabled
    assert (
        "just-in-time checkpoints are off with a sharded optimizer (ZeroRedundancyOptimizer)"
        in caplog.text
    )
    assert ckpt.iter_checkpoints(tmp_path) == [], "no JIT save of a sharded optimizer"


def test_rank0_does_not_write_a_step_another_writer_claimed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tmp_path.mkdir(exist_ok=True)
    ckpt.claim_path(tmp_path, 4).write_text(
        '{"host": "node-b", "pid": 77, "rank": 3, "kind": "jit"}'
    )

    class ClaimAfterStart:  # the claim of a survivor appears while this group is running
        def on_start(self, **kw: Any) -> None:
            ckpt.claim_path(tmp_path, 4).write_text(
                '{"host": "node-b", "pid": 77, "rank": 3, "kind": "jit"}'
            )

        def __getattr__(self, name: str) -> Any:
            return lambda *args, **kwargs: None

    with caplog.at_level(logging.WARNING, logger="elastic_trainer.checkpoint.manager"):
        result = Trainer(
            _config(tmp_path, checkpoint_every=4, max_steps=6), _job(), observer=ClaimAfterStart()
        ).fit()
    assert "step 4 is being checkpointed by" in caplog.text and "node-b" in caplog.text
    assert ckpt.iter_checkpoints(tmp_path) == [6] and result.step == 6
