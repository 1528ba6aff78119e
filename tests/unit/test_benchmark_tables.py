"""The benchmarks never lose their table: the plot library is optional and imported last, and a
failed or interrupted mode still leaves the table of the ones measured before it.

    pytest tests/unit/test_benchmark_tables.py
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def recovery() -> types.ModuleType:
    from benchmarks import recovery

    return recovery


@pytest.fixture(scope="module")
def steps_lost() -> types.ModuleType:
    from benchmarks import steps_lost

    return steps_lost


def outcomes(recovery: types.ModuleType) -> list[Any]:
    """Two systems measured on one scenario: etcd-v3 recovered in 2 s, c10d in 8 s."""
    timeline = [(-1.0, 49, 4), (0.5, 50, 4), (2.0, 41, 4)]
    return [
        recovery.Outcome(
            "worker-sigkill", "fixed", "etcd-v3", recovered_s=2.0, steps_lost=9,
            last_step_before=50, resumed_from=41, timeline=timeline,
        ),
        recovery.Outcome(
            "worker-sigkill", "fixed", "c10d", recovered_s=8.0, steps_lost=10,
            last_step_before=50, resumed_from=40, timeline=timeline,
        ),
    ]  # fmt: skip


def test_without_matplotlib_the_table_and_results_stay_and_one_line_says_why(
    recovery: types.ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    runs = outcomes(recovery)
    chart, results = tmp_path / "timeline.png", tmp_path / "out.json"

    recovery.report(runs, ["etcd-v3", "c10d"], 90.0, chart_path=chart, json_path=results)

    out, err = capsys.readouterr()
    assert err.splitlines() == ["no chart: matplotlib is not installed (pip install -e '.[bench]')"]
    table = recovery.summarise(runs, ["etcd-v3", "c10d"], 90.0)
    assert table in out
    assert "| worker-sigkill | fixed | 2.00 | 9 | 8.00 | 10 | 4.0x |" in table.splitlines()
    assert [o["system"] for o in json.loads(results.read_text())] == ["etcd-v3", "c10d"]
    assert not chart.exists()
    assert "chart:" not in out


def test_the_table_is_printed_before_plotting_starts(
    recovery: types.ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A plot library that breaks while drawing (here a stand-in that fails at once) cannot take
    the table or the JSON with it."""
    broken = types.ModuleType("matplotlib")

    def use(backend: str) -> None:
        raise RuntimeError(f"backend {backend} is broken")

    broken.use = use  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "matplotlib", broken)
    runs = outcomes(recovery)
    results = tmp_path / "out.json"

    with pytest.raises(RuntimeError, match="backend Agg is broken"):
        recovery.report(runs, ["etcd-v3", "c10d"], 90.0, chart_path=tmp_path / "c.png",
                        json_path=results)  # fmt: skip

    assert recovery.summarise(runs, ["etcd-v3", "c10d"], 90.0) in capsys.readouterr().out
    assert results.is_file()


def test_a_failed_mode_keeps_the_modes_measured_before_it(steps_lost: types.ModuleType) -> None:
    def measure(mode: str) -> list[tuple[int, float]]:
        if mode == "jit":
            raise AssertionError("timed out after 300 s waiting for training to progress")
        return [(40, 3.0), (60, 5.0)]

    table, problem = steps_lost.measure_modes(["off", "jit", "off-async"], measure)
    assert table == {"off": [(40, 3.0), (60, 5.0)]}
    assert (
        problem
        == "mode jit failed: AssertionError: timed out after 300 s waiting for training to progress"
    )
    summary = steps_lost.summarise(table)
    assert "| off | 2 | 50.0 | 50 | 60 | 4.0 | 5.0 |" in summary.splitlines()
    assert "jit vs off" not in summary


def test_ctrl_c_keeps_the_modes_measured_before_it(steps_lost: types.ModuleType) -> None:
    def measure(mode: str) -> list[tuple[int, float]]:
        if mode == "jit":
            raise KeyboardInterrupt
        return [(7, 1.0)]

    table, problem = steps_lost.measure_modes(["off", "jit"], measure)
    assert table == {"off": [(7, 1.0)]}
    assert problem == "interrupted during mode jit"


def test_steps_lost_compares_jit_with_periodic_checkpoints(steps_lost: types.ModuleType) -> None:
    table, problem = steps_lost.measure_modes(
        ["off", "jit"], lambda mode: [(50, 4.0)] if mode == "off" else [(0, 2.0)]
    )
    assert problem is None
    assert steps_lost.summarise(table).splitlines()[-1] == (
        "jit vs off: mean steps lost 50.0 -> 0.0 (all of them avoided); median recovery time ratio 0.50"
    )


def test_recovery_sharded_workload_runs_sharded_lm_and_refuses_the_c10d_baseline(
    recovery: types.ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = recovery.BenchConfig(workload="sharded")
    cluster = recovery.Cluster("etcd-v3", "elastic", cfg, tmp_path, "127.0.0.1:2379")
    cmd, _ = cluster.command(0)
    assert cmd[cmd.index("-m", cmd.index("run")) + 1] == "elastic_trainer.examples.sharded_lm"
    with pytest.raises(ValueError, match="workload"):
        recovery.BenchConfig(workload="mlp")
    assert recovery.main(["--workload", "sharded", "--systems", "etcd-v3", "c10d"]) == 2
    assert "the c10d baseline trains the CNN only" in capsys.readouterr().err
