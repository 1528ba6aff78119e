"""Unit tests of TrainerConfig validation and environment precedence."""

from __future__ import annotations

import pytest

from elastic_trainer.train.config import (
    DEFAULT_PG_TIMEOUT_S,
    DEFAULT_SIGTERM_GRACE_S,
    ENV_PG_TIMEOUT_S,
    ENV_SIGTERM_GRACE_S,
    DDPOptions,
    TrainerConfig,
)

pytestmark = pytest.mark.timeout(30)


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_SIGTERM_GRACE_S, raising=False)
    monkeypatch.delenv(ENV_PG_TIMEOUT_S, raising=False)
    cfg = TrainerConfig(global_batch_size=32)
    assert cfg.pg_timeout_s == DEFAULT_PG_TIMEOUT_S == 1800
    assert cfg.sigterm_grace_s == DEFAULT_SIGTERM_GRACE_S == 30
    assert cfg.checkpoint_every == 100 and cfg.mixed_precision == "no"
    assert cfg.to_dict()["ddp"]["broadcast_buffers"] is True


def test_environment_overrides_default_and_argument_overrides_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SIGTERM_GRACE_S, "12.5")
    monkeypatch.setenv(ENV_PG_TIMEOUT_S, "60")
    assert TrainerConfig(global_batch_size=1).sigterm_grace_s == 12.5
    assert TrainerConfig(global_batch_size=1).pg_timeout_s == 60
    assert TrainerConfig(global_batch_size=1, sigterm_grace_s=3).sigterm_grace_s == 3


@pytest.mark.parametrize("value", ["soon", "-1", "0", "nan"])
def test_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_SIGTERM_GRACE_S, value)
    with pytest.raises(ValueError, match=ENV_SIGTERM_GRACE_S):
        TrainerConfig(global_batch_size=1)


@pytest.mark.parametrize(
    "field,value",
    [
        ("global_batch_size", 0),
        ("micro_batch_size", -2),
        ("seed", -1),
        ("epochs", 0),
        ("max_steps", 0),
        ("checkpoint_every", 0),
        ("keep_last", 0),
        ("sigterm_grace_s", 0),
        ("pg_timeout_s", -5),
        ("backend", "mpi"),
        ("mixed_precision", "fp8"),
        ("num_workers", -1),
        ("checkpoint_dir", " "),
        ("async_checkpoint", "yes"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(field: str, value: object) -> None:
    kwargs = {"global_batch_size": 8, field: value}
    with pytest.raises(ValueError, match=f"^{field}:"):
        TrainerConfig(**kwargs)  # type: ignore[arg-type]


def test_ddp_options_are_validated() -> None:
    with pytest.raises(ValueError, match="ddp.bucket_cap_mb"):
        DDPOptions(bucket_cap_mb=0)
    with pytest.raises(ValueError, match="ddp.static_graph"):
        DDPOptions(static_graph="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^ddp:"):
        TrainerConfig(global_batch_size=1, ddp={"bucket_cap_mb": 1})  # type: ignore[arg-type]


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        TrainerConfig(32)  # type: ignore[misc]
