"""The package root and the settings both loops share: at most 20 public names, each importable;
``Elastic`` takes ``RunConfig``'s fields as keyword arguments without restating them.

    pytest tests/unit/test_public_api.py
"""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

import elastic_trainer
from elastic_trainer import CheckpointConfig, Elastic, RunConfig, TrainerConfig
from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.train.config import RunOptions, run_config_from


def test_the_root_has_at_most_20_names_and_each_imports() -> None:
    names = [n for n in elastic_trainer.__all__ if n != "__version__"]
    assert len(names) <= 20, names
    for name in names:
        assert getattr(elastic_trainer, name) is not None


def test_elastic_takes_run_config_fields_without_restating_them() -> None:
    shared = {f.name for f in fields(RunConfig)}
    assert set(RunOptions.__annotations__) == shared  # the keyword form names every field
    own = set(inspect.signature(Elastic.__init__).parameters)
    assert not own & shared, own & shared  # no default written twice
    assert issubclass(TrainerConfig, RunConfig)  # the Trainer's config is a RunConfig


def test_keyword_settings_become_a_run_config_with_its_defaults() -> None:
    config = run_config_from(None, {"global_batch_size": 8}, "ckpt", None)
    assert config == RunConfig(
        global_batch_size=8, checkpoint=CheckpointConfig(directory="ckpt", every=100)
    )
    given = TrainerConfig(global_batch_size=4)
    assert run_config_from(given, {}) is given


@pytest.mark.parametrize(
    ("config", "options", "checkpoint_dir", "message"),
    [
        (
            None,
            {"global_batch_size": 8, "max_step": 3},
            None,
            "Elastic(max_step=...): not a setting",
        ),
        (None, {}, None, "Elastic: global_batch_size= is required"),
        (RunConfig(global_batch_size=8), {"seed": 1}, None, "pass seed inside it, not beside it"),
        (
            None,
            {"global_batch_size": 8, "checkpoint": CheckpointConfig()},
            "ckpt",
            "give checkpoint= or checkpoint_dir=/checkpoint_every=, not both",
        ),
        (None, {"global_batch_size": 0}, None, "global_batch_size"),
    ],
)
def test_a_bad_setting_is_one_line(
    config: RunConfig | None, options: dict[str, object], checkpoint_dir: str | None, message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        run_config_from(config, options, checkpoint_dir)
    assert message in str(refused.value) and "\n" not in str(refused.value)
