"""In-process tests of the Trainer (one rank, gloo over an in-process store): math, resume,
checkpoint contents, refusal of bad setups, observer calls and the SIGTERM path.

Multi-rank behaviour (invariance over world sizes, restarts under torchrun) is in
tests/integration/test_runtime_*.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.metrics.choice import MetricsSetupError, build_observer
from elastic_trainer.runtime import rng
from elastic_trainer.runtime.comms import WorkerComms
from elastic_trainer.runtime.exit_codes import EXIT_STOPPED
from elastic_trainer.train.trainer import (
    Trainer,
    TrainerSetupError,
    TrainingJob,
)
from tests.support.configs import trainer_config

pytestmark = pytest.mark.timeout(120)


def _data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def _job(
    *, dropout: float = 0.2, width: int = 16, batchnorm: bool = False, model: Any = None
) -> TrainingJob:
    def build() -> nn.Module:
        if model is not None:
            return model()
        layers: list[nn.Module] = [nn.Linear(6, width)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(width))
        layers += [nn.ReLU(), nn.Dropout(dropout), nn.Linear(width, 2)]
        return nn.Sequential(*layers)

    return TrainingJob(
        model=build,
        dataset=_data,
        optimizer=lambda p: torch.optim.AdamW(p, lr=0.01),
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        loss=nn.CrossEntropyLoss(),
    )


def _fit(job: TrainingJob, **cfg: Any) -> tuple[Trainer, Any]:
    cfg.setdefault("global_batch_size", 8)
    cfg.setdefault("log_every", 1000)
    trainer = Trainer(trainer_config(**cfg), job)
    return trainer, trainer.fit()


def _weights(path: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_checkpoint_holds_full_state_and_plain_load_gives_state_dict(tmp_path: Path) -> None:
    trainer, result = _fit(_job(), max_steps=5, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    assert result.step == 5 and not result.stopped_by_signal and result.exit_code == 0
    state = torch.load(result.checkpoint, weights_only=True)
    assert {
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "sampler",
        "rng",
        "step",
        "epoch",
        "world_size",
        "fingerprint",
        "config",
    } <= state.keys()
    assert (
        state["step"] == 5
        and state["world_size"] == 1
        and state["sampler"] == {"epoch": 0, "cursor": 40}
    )
    assert state["rng"] == {
        "scheme": rng.STEP_SCHEME,
        "seed": 0,
    }  # streams derive from (seed, rank, step)
    _assert_bitwise_equal(state["model"], {k: v for k, v in trainer.model.state_dict().items()})
    assert list(ckpt.iter_checkpoints(tmp_path)) == [2, 4, 5]


def test_max_steps_alone_runs_past_the_first_epoch() -> None:
    """48 samples, global batch 8: 6 steps an epoch. ``max_steps=9`` alone (no ``epochs``) runs
    all 9 steps, into the second epoch; without either, one epoch (issue 29's trap, in Trainer)."""
    trainer, result = _fit(_job(), max_steps=9)
    assert (result.step, result.epoch, trainer.total_steps) == (9, 1, 9)
    trainer, result = _fit(_job())
    assert (result.step, trainer.total_steps) == (6, 6)
    trainer, result = _fit(_job(), max_steps=9, epochs=1)  # asked for: one epoch caps it
    assert (result.step, trainer.total_steps) == (6, 6)


def test_one_step_is_the_mean_loss_gradient_over_the_global_batch() -> None:
    job = TrainingJob(
        model=lambda: nn.Linear(6, 2),
        dataset=_data,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
    )
    trainer, _ = _fit(job, max_steps=1, shuffle=False, micro_batch_size=3)  # 3 + 3 + 2 accumulated
    torch.manual_seed(0)
    reference = nn.Linear(6, 2)
    x, y = _data()[:8]
    nn.CrossEntropyLoss()(reference(x), y).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    for a, b in zip(trainer.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_same_seed_gives_identical_initial_weights_and_run(tmp_path: Path) -> None:
    _, first = _fit(_job(), max_steps=4, checkpoint_dir=str(tmp_path / "a"), seed=7)
    _, second = _fit(_job(), max_steps=4, checkpoint_dir=str(tmp_path / "b"), seed=7)
    _, other = _fit(_job(), max_steps=4, checkpoint_dir=str(tmp_path / "c"), seed=8)
    _assert_bitwise_equal(_weights(first.checkpoint), _weights(second.checkpoint))
    assert not torch.equal(
        _weights(first.checkpoint)["0.weight"], _weights(other.checkpoint)["0.weight"]
    )


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_resume_after_a_crash_is_bitwise_equal_to_an_uninterrupted_run(
    tmp_path: Path, async_checkpoint: bool
) -> None:
    """Dropout + AdamW + StepLR, two epochs: replay needs sampler cursor, RNG, optimizer, scheduler."""
    _, straight = _fit(
        _job(),
        max_steps=11,
        epochs=2,
        checkpoint_dir=str(tmp_path / "straight"),
        checkpoint_every=4,
    )
    crashed = tmp_path / "crashed"
    _fit(
        _job(),
        max_steps=7,
        epochs=2,
        checkpoint_dir=str(crashed),
        checkpoint_every=4,
        async_checkpoint=async_checkpoint,
    )
    for suffix in ("pt", "json"):  # the crash came after step 7, before its checkpoint existed
        (crashed / f"ckpt-000000000007.{suffix}").unlink()
    trainer, resumed = _fit(
        _job(),
        max_steps=11,
        epochs=2,
        checkpoint_dir=str(crashed),
        checkpoint_every=4,
        async_checkpoint=async_checkpoint,
    )
    assert resumed.resumed_from == 4 and resumed.step == 11 and resumed.epoch == 1
    _assert_bitwise_equal(_weights(straight.checkpoint), _weights(resumed.checkpoint))


def test_resume_without_per_step_reseeding_is_not_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control for the test above: the resumed run matches only because every step reseeds
    from (seed, rank, step); a resume that kept whatever generator state it starts with differs."""
    _, straight = _fit(
        _job(), max_steps=8, checkpoint_dir=str(tmp_path / "straight"), checkpoint_every=4
    )
    crashed = tmp_path / "crashed"
    _fit(_job(), max_steps=4, checkpoint_dir=str(crashed), checkpoint_every=4)
    monkeypatch.setattr(rng, "seed_step", lambda *args, **kwargs: None)
    _, resumed = _fit(_job(), max_steps=8, checkpoint_dir=str(crashed), checkpoint_every=4)
    assert resumed.resumed_from == 4
    differing = [
        k
        for k, v in _weights(straight.checkpoint).items()
        if not torch.equal(v, _weights(resumed.checkpoint)[k])
    ]
    assert differing, (
        "dropout drew the same numbers without reseeding: the bitwise test proves nothing"
    )


def test_gradient_accumulation_matches_one_big_forward() -> None:
    whole, _ = _fit(_job(dropout=0.0), max_steps=3)
    accumulated, _ = _fit(_job(dropout=0.0), max_steps=3, micro_batch_size=3)
    for a, b in zip(whole.model.parameters(), accumulated.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_static_graph_with_gradient_accumulation_trains_like_a_dynamic_graph() -> None:
    """The first step accumulates under ``no_sync``; a static graph needs a synchronised first
    backward (torch asserts otherwise), which the start's priming pass provides."""
    from elastic_trainer.train.config import DDPOptions

    dynamic, _ = _fit(_job(dropout=0.0), max_steps=3, micro_batch_size=3)
    static, result = _fit(
        _job(dropout=0.0), max_steps=3, micro_batch_size=3, ddp=DDPOptions(static_graph=True)
    )
    assert result.step == 3
    _assert_bitwise_equal(dynamic.model.state_dict(), static.model.state_dict())


def test_corrupt_newest_checkpoint_resumes_from_the_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _fit(_job(), max_steps=6, epochs=2, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    newest = tmp_path / "ckpt-000000000006.pt"
    with open(newest, "r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING):
        _, result = _fit(
            _job(), max_steps=8, epochs=2, checkpoint_dir=str(tmp_path), checkpoint_every=3
        )
    assert result.resumed_from == 3 and result.step == 8
    assert str(newest) in caplog.text


def test_foreign_checkpoint_is_a_clear_error_and_overwrites_nothing(tmp_path: Path) -> None:
    _fit(_job(width=16), max_steps=3, checkpoint_dir=str(tmp_path))
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    with pytest.raises(
        ckpt.CheckpointMismatchError, match=r"belongs to a different job \(model tensor '0.weight'"
    ):
        _fit(_job(width=32), max_steps=6, checkpoint_dir=str(tmp_path))
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    assert after == before


def test_data_parallel_is_refused() -> None:
    with pytest.raises(
        TrainerSetupError, match="nn.DataParallel is single-process and not supported"
    ):
        _fit(_job(model=lambda: nn.DataParallel(nn.Linear(6, 2))), max_steps=1)


@pytest.mark.parametrize(
    "option,match",
    [
        ({"sync_batchnorm": True}, "SyncBatchNorm runs on CUDA"),
        ({"mixed_precision": "fp16"}, "fp16 .* needs CUDA"),
    ],
)
def test_cuda_only_options_on_cpu_are_clear_errors(option: dict[str, Any], match: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(TrainerSetupError, match=match):
        _fit(_job(), max_steps=1, **option)


def test_bf16_autocast_runs_on_cpu() -> None:
    _, result = _fit(_job(), max_steps=2, mixed_precision="bf16")
    assert result.loss is not None and result.loss == result.loss  # finite, not NaN


def test_zero_redundancy_optimizer_is_consolidated_into_the_checkpoint(tmp_path: Path) -> None:
    trainer, result = _fit(_job(), max_steps=3, zero_redundancy=True, checkpoint_dir=str(tmp_path))
    state = torch.load(result.checkpoint, weights_only=True)["optimizer"]
    assert len(state["state"]) == len(list(trainer.model.parameters()))
    _, resumed = _fit(_job(), max_steps=5, zero_redundancy=True, checkpoint_dir=str(tmp_path))
    assert resumed.resumed_from == 3 and resumed.step == 5


class NullObserverWithoutPriming:
    def on_start(self, **kw: Any) -> None: ...
    def on_step(self, **kw: Any) -> None: ...
    def on_checkpoint_saved(self, **kw: Any) -> None: ...
    def on_checkpoint_loaded(self, **kw: Any) -> None: ...
    def wrap_ddp(self, ddp_model: Any) -> None: ...


class RecordingObserver:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def on_start(self, **kw: Any) -> None:
        self.events.append(("start", kw))

    def on_step(self, **kw: Any) -> None:
        self.events.append(("step", kw))

    def on_priming(self, **kw: Any) -> None:
        self.events.append(("priming", kw))

    def on_checkpoint_saved(self, **kw: Any) -> None:
        self.events.append(("saved", kw))

    def on_checkpoint_loaded(self, **kw: Any) -> None:
        self.events.append(("loaded", kw))

    def wrap_ddp(self, ddp_model: Any) -> None:
        self.events.append(("wrap", {"ddp": type(ddp_model).__name__}))


def test_observer_sees_wrap_start_steps_and_checkpoints(tmp_path: Path) -> None:
    observer = RecordingObserver()
    Trainer(
        trainer_config(
            global_batch_size=8, max_steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2
        ),
        _job(),
        observer=observer,
    ).fit()
    kinds = [kind for kind, _ in observer.events]
    # A step's loss is staged without waiting for the device and rides on the next step's control,
    # which is read one step later still (no wait on the host collective): step 1 is reported at
    # the end of step 3, after step 2's checkpoint; the end reports the rest.
    assert kinds == ["wrap", "start", "saved", "step", "step", "saved", "step", "step"]
    assert observer.events[0][1]["ddp"] == "DistributedDataParallel"
    steps = [kw for kind, kw in observer.events if kind == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and all(s["samples"] == 8 for s in steps)
    assert all(kw["nbytes"] > 0 for kind, kw in observer.events if kind == "saved")
    observer2 = RecordingObserver()
    Trainer(
        trainer_config(global_batch_size=8, max_steps=5, checkpoint_dir=str(tmp_path)),
        _job(),
        observer=observer2,
    ).fit()
    loaded = [kw for kind, kw in observer2.events if kind == "loaded"]
    assert len(loaded) == 1 and loaded[0]["step"] == 4


def test_sigterm_finishes_the_step_checkpoints_it_and_exits_nonzero(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGTERM)

    class KillAtStep3(RecordingObserver):
        def on_step(self, **kw: Any) -> None:
            if kw["step"] == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    result = Trainer(
        trainer_config(
            global_batch_size=8,
            max_steps=50,
            epochs=10,
            checkpoint_dir=str(tmp_path),
            checkpoint_every=100,
        ),
        _job(),
        observer=KillAtStep3(),
    ).fit()
    assert result.stopped_by_signal and result.exit_code == EXIT_STOPPED
    # Step 3 is reported at the end of step 5 (its loss rides on step 4's control, read after step
    # 5): the flag rides on step 6's control, read after step 7. Step in progress + one more.
    assert result.step == 7
    assert list(ckpt.iter_checkpoints(tmp_path)) == [result.step]
    assert signal.getsignal(signal.SIGTERM) is previous


def test_build_observer_defaults_to_null_and_reports_missing_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elastic_trainer.runtime.observer import NullObserver

    monkeypatch.delenv("ELASTIC_TRAINER_METRICS", raising=False)
    assert isinstance(build_observer(), NullObserver)
    monkeypatch.setenv("ELASTIC_TRAINER_METRICS", "1")
    monkeypatch.setitem(
        __import__("sys").modules, "elastic_trainer.metrics.worker", None
    )  # not importable
    with pytest.raises(
        MetricsSetupError, match="ELASTIC_TRAINER_METRICS=1 but elastic_trainer.metrics.worker"
    ):
        build_observer()


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_full_disk_is_a_clear_error_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_checkpoint: bool
) -> None:
    """ENOSPC injected into the checkpoint file writes once step 4's checkpoint exists."""
    real_write = ckpt._HashingWriter.write

    def write(self: Any, data: bytes) -> int:
        if (tmp_path / "ckpt-000000000004.json").exists():
            raise OSError(28, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(ckpt._HashingWriter, "write", write)
    with pytest.raises(ckpt.CheckpointWriteError) as error:
        _fit(
            _job(),
            max_steps=20,
            epochs=4,
            checkpoint_dir=str(tmp_path),
            checkpoint_every=4,
            async_checkpoint=async_checkpoint,
        )
    message = str(error.value)
    assert "could not write the checkpoint of step 8" in message and "the disk is full" in message
    assert "ckpt-000000000004.pt is untouched" in message
    monkeypatch.undo()
    assert list(ckpt.iter_checkpoints(tmp_path)) == [4]
    assert ckpt.find_latest(tmp_path).step == 4
    assert torch.load(tmp_path / "ckpt-000000000004.pt", weights_only=True)["step"] == 4
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_unusable_checkpoint_dir_is_a_clear_error(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    with pytest.raises(ckpt.CheckpointError, match="exists and is not a directory"):
        _fit(_job(), max_steps=1, checkpoint_dir=str(a_file))
    with pytest.raises(ckpt.CheckpointError, match="cannot be used: Not a directory"):
        _fit(_job(), max_steps=1, checkpoint_dir=str(a_file / "sub"))


def test_dataset_without_length_is_a_clear_error() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # noqa: ANN204
            yield from ()

    job = _job()
    job.dataset = Stream
    with pytest.raises(TrainerSetupError, match="needs a map-style dataset"):
        _fit(job, max_steps=1)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpu_mixed_precision_syncbn_checkpoint_loads_on_cpu_and_resumes(
    tmp_path: Path, precision: str
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (gpu marker)")
    options: dict[str, Any] = {
        "checkpoint_dir": str(tmp_path),
        "mixed_precision": precision,
        "sync_batchnorm": True,
        "epochs": 2,
    }
    trainer, result = _fit(_job(batchnorm=True), max_steps=4, **options)
    assert next(trainer.model.parameters()).device == torch.device("cuda", 0)
    assert isinstance(trainer.model[1], nn.SyncBatchNorm)
    saved = torch.load(result.checkpoint, weights_only=True, map_location="cpu")
    assert (saved["scaler"] is not None) == (precision == "fp16")
    on_cpu = ckpt.load_checkpoint(result.checkpoint, torch.device("cpu"))
    assert {t.device.type for t in on_cpu["model"].values()} == {"cpu"}
    on_gpu = ckpt.load_checkpoint(result.checkpoint, torch.device("cuda", 0))
    assert {t.device.type for t in on_gpu["model"].values()} == {"cuda"}
    _, resumed = _fit(_job(batchnorm=True), max_steps=6, **options)
    assert resumed.resumed_from == 4 and resumed.step == 6


# -- buffers: DDP's forward broadcast, or rank 0's buffers on the control allreduce ------------------------
@pytest.mark.parametrize(
    ("world", "batchnorm", "broadcast", "forward_sync", "gpus"),
    [
        (3, True, True, False, 0),  # rank 0's buffers ride on the control: DDP's broadcast is off
        (3, False, True, True, 0),  # no buffers: DDP's setting as configured
        (3, True, False, False, 0),  # the user turned broadcasting off: nothing replaces it
        (1, True, True, True, 0),  # one rank: nothing rides
        (3, True, True, True, 1),  # CUDA: the ride would make the host wait for the device
    ],
)
def test_ddp_broadcasts_buffers_only_where_the_control_does_not_carry_them(
    world: int, batchnorm: bool, broadcast: bool, forward_sync: bool, gpus: int
) -> None:
    from elastic_trainer.runtime.distributed import read_env

    env = read_env(
        environ={"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}, cuda_devices=gpus
    )
    assert env.device.type == ("cuda" if gpus else "cpu")
    from elastic_trainer.train.elastic import Elastic

    model = _job(batchnorm=batchnorm).model()
    elastic = Elastic(
        model, _data(), global_batch_size=8, env=env, ddp_options={"broadcast_buffers": broadcast}
    )
    kwargs, rides = elastic.ddp_kwargs(env)
    assert kwargs["forward_sync_buffers"] is forward_sync
    assert rides is (broadcast and not forward_sync), (
        "rank 0's buffers ride where DDP does not broadcast them"
    )


@pytest.mark.parametrize(("from_peer", "broadcasts"), [(False, 1), (True, 0)])
def test_ddp_broadcasts_the_module_at_construction_only_without_a_peer_s_state(
    gloo_world: None, monkeypatch: pytest.MonkeyPatch, from_peer: bool, broadcasts: int
) -> None:
    """After a heal every member restores the same peer state when its loop starts: DDP's
    construction-time broadcast is redundant there, and no abort reaches it."""
    from torch.nn.parallel import distributed as ddp_module

    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.runtime.observer import NullObserver
    from elastic_trainer.train.elastic_group import Attempt

    synced: list[int] = []
    real = ddp_module._sync_module_states

    def counting(**kwargs: Any) -> None:
        synced.append(1)
        real(**kwargs)

    monkeypatch.setattr(ddp_module, "_sync_module_states", counting)
    env = read_env(environ={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, cuda_devices=0)
    from elastic_trainer.train.elastic import Elastic

    elastic = Elastic(
        _job().model(), _data(), global_batch_size=8, env=env, observer=NullObserver()
    )
    group = SimpleNamespace(healer=None, comms=WorkerComms())
    attempt = Attempt(group, env, {"step": 3} if from_peer else None)  # type: ignore[arg-type]
    assert attempt.ddp_init_sync is not from_peer
    elastic._start_attempt(attempt)
    assert len(synced) == broadcasts
    attempt.initial_state = None  # what Attempt.loop() does: the answer must not change with it
    assert attempt.ddp_init_sync is not from_peer


# -- DDP bucket priming after a restart (the 3-rank bitwise tests are in tests/integration) ----------------
@pytest.mark.parametrize(
    ("step", "world", "ddp", "passes"),
    [
        (0, 3, {}, 0),  # a fresh start: the uninterrupted run started the same way
        (5, 1, {}, 0),  # one rank: nothing to reduce
        (5, 3, {}, 1),  # the reducer rebuilds after the first synchronised backward
        (5, 3, {"static_graph": True}, 2),  # ... one iteration later with a static graph
        # A static graph's first backward must synchronise: every start primes once, so the
        # uninterrupted run had rebuilt by its second step and a resume at step 1 primes twice.
        (0, 3, {"static_graph": True}, 1),
        (0, 1, {"static_graph": True}, 1),
        (5, 1, {"static_graph": True}, 1),
        (1, 3, {"static_graph": True}, 2),
        (5, 3, {"find_unused_parameters": True}, 0),  # never rebuilt
        (5, 3, {"find_unused_parameters": True, "static_graph": True}, 2),
    ],
)
def test_priming_passes_follow_ddps_bucket_rebuild(
    step: int, world: int, ddp: dict[str, bool], passes: int
) -> None:
    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.train.config import DDPOptions

    trainer = Trainer(
        trainer_config(global_batch_size=8, ddp=DDPOptions(**ddp)),
        _job(),
        env=read_env(environ={"RANK": "0", "WORLD_SIZE": str(world)}, cuda_devices=0),
    )
    trainer.loop = SimpleNamespace(step=step)  # type: ignore[assignment]  # a loop resumed at `step`
    assert trainer._priming_passes() == passes


class _Primed(Exception):
    """Ends a step after its priming (the rest of the step is not under test)."""


def test_a_heal_that_grows_the_world_primes_on_the_new_world(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A survivor of a one-rank job healed in place to three ranks (issue 30): its first step in
    the new attempt primes DDP's buckets as the newcomers do, who start in that world. The trainer
    once kept the world it started in: the survivor primed no pass, the newcomers one, their
    collectives did not pair up (a hang with the control carried by a gradient, a failed heal and
    a restart without). Rank and world follow the attempt (``trainer.env``)."""
    from elastic_trainer.runtime.distributed import read_env

    def env(rank: int, world: int) -> Any:
        return read_env(environ={"RANK": str(rank), "WORLD_SIZE": str(world)}, cuda_devices=0)

    trainer = Trainer(trainer_config(global_batch_size=8), _job(), env=env(0, 1))
    primed: list[int] = []

    def prime(batches: Any, *, passes: int) -> Any:
        primed.append(passes)
        return batches

    def end_step(**kw: Any) -> None:
        raise _Primed

    monkeypatch.setattr(trainer, "_prime_buckets", prime)
    trainer.optimizer = SimpleNamespace(zero_grad=end_step)  # type: ignore[assignment]
    healed = env(2, 3)
    trainer.elastic = SimpleNamespace(  # type: ignore[assignment]  # the attempt after the heal
        env=healed,
        loop=SimpleNamespace(step=5, checkpoints=None),  # resumed at step 5 from a peer
        module=nn.Linear(2, 2),
        state=SimpleNamespace(sharded=None),  # a DDP model
        peek_batch=lambda plan: (torch.zeros(1, 2), torch.zeros(1)),
    )
    with pytest.raises(_Primed):
        trainer._train_step(SimpleNamespace(plan=None))  # type: ignore[arg-type]
    assert primed == [1] and trainer.env is healed


def test_priming_runs_real_passes_and_leaves_no_trace(tmp_path: Path) -> None:
    """BatchNorm statistics, every RNG, gradients, optimizer, sampler: as before the passes; the
    micro-batch it used is handed back to the step."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer, _ = _fit(
            _job(batchnorm=True, dropout=0.5), max_steps=2, checkpoint_dir=str(tmp_path)
        )
        calls: list[int] = []
        trainer.model.register_forward_hook(lambda *_: calls.append(1))
        buffers = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        optimizer = str(trainer.optimizer.state_dict())
        cursor = trainer.sampler.state_dict()
        batches = [
            (torch.randn(4, 6), torch.tensor([0, 1, 0, 1])),
            (torch.randn(4, 6), torch.tensor([1, 1, 0, 0])),
        ]
        generator = torch.get_rng_state()  # after the draws that made the batches
        trainer.ddp.train()
        trainer.observer = observer = RecordingObserver()
        handed_back = list(trainer._prime_buckets(iter(batches), passes=2))
        assert len(calls) == 2, "two real forward passes"
        # The metrics hook timed two backward passes that no step will report.
        assert observer.events == [("priming", {"backward_passes": 2})]
        assert handed_back[0] is batches[0] and handed_back[1] is batches[1]
        _assert_bitwise_equal(trainer.model.state_dict(), buffers)
        assert torch.equal(torch.get_rng_state(), generator), "dropout's draws were undone"
        trainer.model(
            batches[0][0]
        )  # one more forward, not undone: dropout does draw from this generator
        assert not torch.equal(torch.get_rng_state(), generator), (
            "the passes drew random numbers to undo"
        )
        assert all(p.grad is None for p in trainer.model.parameters())
        assert (
            str(trainer.optimizer.state_dict()) == optimizer
            and trainer.sampler.state_dict() == cursor
        )
        assert trainer.step == 2
        trainer.observer = (
            NullObserverWithoutPriming()
        )  # written before on_priming existed: no error
        assert len(list(trainer._prime_buckets(iter(batches), passes=1))) == 2
    finally:
        dist.destroy_process_group()
