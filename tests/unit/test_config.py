"""Unit tests of TrainerConfig/CheckpointConfig validation and the worker settings' precedence
(value in code > environment > default)."""

from __future__ import annotations

import pytest

from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.runtime.settings import (
    DEFAULT_PG_TIMEOUT_S,
    DEFAULT_SIGTERM_GRACE_S,
    ENV_JIT_SAVE,
    ENV_METRICS_ALLREDUCE,
    ENV_PG_TIMEOUT_S,
    ENV_SIGTERM_GRACE_S,
    WorkerSettings,
)
from elastic_trainer.train.config import DDPOptions, TrainerConfig

pytestmark = pytest.mark.timeout(30)


def test_defaults() -> None:
    cfg, settings = TrainerConfig(global_batch_size=32), WorkerSettings.from_environ({})
    assert cfg.pg_timeout(settings) == DEFAULT_PG_TIMEOUT_S == 1800
    assert cfg.sigterm_grace(settings) == DEFAULT_SIGTERM_GRACE_S == 30
    assert (
        cfg.checkpoint.every == 100
        and cfg.checkpoint.directory is None
        and cfg.mixed_precision == "no"
    )
    assert settings.jit_save and settings.metrics_allreduce == "sampled" and not settings.metrics
    assert (
        cfg.to_dict()["ddp"]["broadcast_buffers"] is True
        and cfg.to_dict()["checkpoint"]["every"] == 100
    )


def test_environment_overrides_default_and_code_overrides_environment() -> None:
    settings = WorkerSettings.from_environ(
        {ENV_SIGTERM_GRACE_S: "12.5", ENV_PG_TIMEOUT_S: "60", ENV_JIT_SAVE: "0"}
    )
    assert TrainerConfig(global_batch_size=1).sigterm_grace(settings) == 12.5
    assert TrainerConfig(global_batch_size=1).pg_timeout(settings) == 60
    assert TrainerConfig(global_batch_size=1, sigterm_grace_s=3).sigterm_grace(settings) == 3
    assert settings.jit_save is False and CheckpointConfig(jit_save=True).jit_save is True


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (ENV_SIGTERM_GRACE_S, "soon"),
        (ENV_SIGTERM_GRACE_S, "-1"),
        (ENV_PG_TIMEOUT_S, "0"),
        (ENV_PG_TIMEOUT_S, "nan"),
        (ENV_JIT_SAVE, "sometimes"),
        (ENV_METRICS_ALLREDUCE, "traec"),
        (ENV_METRICS_ALLREDUCE, "hook"),  # removed in issue 30: refused, not silently changed
    ],
)
def test_bad_environment_value_names_the_variable(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        WorkerSettings.from_environ({name: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("global_batch_size", 0),
        ("micro_batch_size", -2),
        ("seed", -1),
        ("epochs", 0),
        ("max_steps", 0),
        ("sigterm_grace_s", 0),
        ("pg_timeout_s", -5),
        ("grad_clip_norm", 0),
        ("eval_every", 0),
        ("backend", "mpi"),
        ("mixed_precision", "fp8"),
        ("num_workers", -1),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(field: str, value: object) -> None:
    kwargs = {"global_batch_size": 8, field: value}
    with pytest.raises(ValueError, match=f"^{field}:"):
        TrainerConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("every", 0),
        ("keep_last", 0),
        ("directory", " "),
        ("async_write", "yes"),
        ("jit_save", "yes"),
    ],
)
def test_invalid_checkpoint_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^checkpoint.{field}:"):
        CheckpointConfig(**{field: value})  # type: ignore[arg-type]


def test_sections_are_validated() -> None:
    with pytest.raises(ValueError, match="ddp.bucket_cap_mb"):
        DDPOptions(bucket_cap_mb=0)
    with pytest.raises(ValueError, match="ddp.static_graph"):
        DDPOptions(static_graph="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^ddp:"):
        TrainerConfig(global_batch_size=1, ddp={"bucket_cap_mb": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^checkpoint:"):
        TrainerConfig(global_batch_size=1, checkpoint={"directory": "/x"})  # type: ignore[arg-type]


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        TrainerConfig(32)  # type: ignore[misc]
