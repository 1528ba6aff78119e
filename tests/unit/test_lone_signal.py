"""A stop signal that is not the launcher's ends a worker that heals in place like a kill."""

from __future__ import annotations

from pathlib import Path

from elastic_trainer.runtime.settings import ENV_HEAL_MARKER, ENV_STOPPING_FILE
from elastic_trainer.runtime.signals import lone_signal


def test_only_a_healing_worker_whose_launcher_is_not_stopping_takes_a_signal_for_a_kill(
    tmp_path: Path,
) -> None:
    marker, stopping = tmp_path / "heals-123", tmp_path / "agent-stopping"
    env = {ENV_HEAL_MARKER: str(marker), ENV_STOPPING_FILE: str(stopping)}
    assert not lone_signal(env), "no heal marker yet: this worker does not heal in place"
    marker.touch()
    assert lone_signal(env), "heals in place, and the launcher is not stopping its workers"
    stopping.touch()
    assert not lone_signal(env), "the launcher's own stop: the graceful path"
    stopping.unlink()
    assert not lone_signal({ENV_HEAL_MARKER: str(marker)}), (
        "no stopping file named (cold start, torchrun)"
    )
    assert not lone_signal({}), "outside elastic-trainer run"
