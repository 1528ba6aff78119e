"""``elastic-trainer demo`` options: ``--sharded`` reaches the demo's parser through the CLI and
runs the FSDP2 example's own loop, healing in place; bad values are one line. (The demo itself runs in
tests/integration/test_readme.py; ``--sharded`` end to end: benchmarks/RESULTS.md.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_trainer import cli
from elastic_trainer.ops import demo


def test_sharded_runs_sharded_lm_on_its_own_loop_with_healing_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = demo.Demo
    jobs: list[tuple[demo.DemoSettings, list[str]]] = []

    class Recorder:
        def __init__(self, settings: demo.DemoSettings) -> None:
            jobs.append((settings, real(settings)._job()))

        def run(self) -> int:
            return 0

    monkeypatch.setattr(demo, "Demo", Recorder)
    assert cli.main(["demo", "--sharded", "--max-steps", "300", "--dir", str(tmp_path)]) == 0
    assert cli.main(["demo", "--max-steps", "300", "--dir", str(tmp_path)]) == 0
    (sharded, command), (plain, plain_command) = jobs
    assert sharded.sharded and sharded.max_steps == 300 and not plain.sharded
    assert command[:4] == ["-m", "elastic_trainer.examples.sharded_lm", "--api", "loop"]
    assert "--heal" not in command and "--heal" not in plain_command  # in place: the default
    assert plain_command[:2] == ["-m", "elastic_trainer.examples.synthetic_cnn"]


def test_a_bad_value_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--sharded", "--max-steps", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elastic-trainer demo: error: --max-steps: at least 100")
    assert err.count("\n") == 1
