"""benchmarks/rendezvous_scale.py never loses its table: it prints the tables and writes the JSON
before it imports the plot library, skips only the chart (one line) without it, and redraws both
from a JSON file."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def scale() -> Iterator[types.ModuleType]:
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location(
        "bench_rendezvous_scale", REPO / "benchmarks" / "rendezvous_scale.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.path[:] = path
    sys.modules.pop(spec.name, None)


def results(scale: types.ModuleType) -> list:
    load = {
        "requests": 8.0,
        "writes": 3.0,
        "bytes": 5000.0,
        "server_cpu_s": 0.5,
        "sim_cpu_s": 2.0,
        "kinds": {},
        "per_minute": {
            "requests": 18.0,
            "server_messages": 18.0,
            "bytes": 900.0,
            "server_cpu_s": 4.0,
        },
    }
    release = {"p50": 0.2, "p99": 0.4, "last": 0.45}
    r = scale.Result
    return [
        r("etcd", 0, "idle", load={"per_minute": {"server_cpu_s": 2.5}}),
        r("lease", 1024, "first", release=release, load=load, extra={"after_last_join": load}),
        r("lease", 1024, "restart", release={"p50": 1.0, "p99": 1.2, "last": 1.3}, load=load),
        r("lease", 1024, "steady", load=load, db_bytes=2**20, keys=2050, extra={"watchers": 2051}),
        r("c10d", 1024, "first", release={"p50": 8.0, "p99": 12.0, "last": 12.5}, load=load),
        r("c10d", 4096, "first", ok=False, note="1000 of 4095 joined within 240s"),
        r(
            "lease",
            1024,
            "etcd-leader-killed",
            release=release,
            load=load,
            extra={"first_rejoin_s": 0.0, "agents": 1024},
        ),
    ]


def test_the_tables_come_first_and_survive_a_missing_matplotlib(
    scale, tmp_path, capsys, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    json_path, chart_path = tmp_path / "r.json", tmp_path / "r.png"
    scale.report(results(scale), chart_path=chart_path, json_path=json_path)
    out, err = capsys.readouterr()
    assert "| lease | 1,024 | 0.200 | 0.400 | 0.450 |" in out
    assert "| c10d | 4,096 | 1000 of 4095 joined within 240s |" in out
    assert "N=1,024: c10d/lease p99 30.0x" in out
    assert "| 1,024 | etcd-leader-killed | 1024 |" in out
    assert "An idle 3-member cluster (no client) uses 2.50 CPU s/min" in out
    assert json_path.exists() and not chart_path.exists()
    assert err.strip().splitlines() == [scale.NO_MATPLOTLIB]


def test_replot_reads_the_json_back(scale, tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    json_path = tmp_path / "r.json"
    scale.report(results(scale), chart_path=None, json_path=json_path)
    first = capsys.readouterr().out.split("results:")[0]
    assert scale.main(["--replot", str(json_path), "--no-chart"]) == 0
    assert capsys.readouterr().out.strip() == first.strip()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "1"], "every N must be >= 2"),
        (["--scenarios", "lose-everything"], "unknown lose-everything"),
    ],
)
def test_bad_arguments_are_one_line(scale, argv, message, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as raised:
        scale.parse_args(argv)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


class _Member:
    def __init__(self, name: str, *, running: bool = True) -> None:
        self.member = types.SimpleNamespace(name=name)
        self.running = running

    def is_running(self) -> bool:
        return self.running


def _cluster(
    scale: types.ModuleType,
    readings: list[dict[str, dict[str, float]]],
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[object, list[float]]:
    """A Cluster whose members' gauges come from ``readings``, one dict per check round (the last
    repeats); sleeps are recorded, not slept."""
    cluster = object.__new__(scale.Cluster)
    cluster.servers = [_Member("m0"), _Member("m1"), _Member("m2", running=False)]
    rounds = iter(readings)
    current: dict[str, dict[str, float]] = {}

    def gauges(server: _Member) -> dict[str, float]:
        nonlocal current
        if server is cluster.servers[0]:
            current = next(rounds, current)
        return current[server.member.name]

    slept: list[float] = []
    monkeypatch.setattr(cluster, "_gauges", gauges)
    monkeypatch.setattr(scale.time, "sleep", slept.append)
    return cluster, slept


def _g(applied: float, revision: float) -> dict[str, float]:
    return {
        "etcd_server_proposals_applied_total": applied,
        "etcd_debugging_mvcc_current_revision": revision,
    }


def test_members_that_caught_up_and_agree_pass(
    scale: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, slept = _cluster(
        scale,
        [
            {"m0": _g(90, 40), "m1": _g(88, 39)},  # m1 still catching up
            {"m0": _g(90, 40), "m1": _g(90, 40)},
        ],
        monkeypatch,
    )
    cluster.check_consistent()
    assert slept == [0.2], (
        "one wait for the revived member to catch up; the stopped member is not asked"
    )


def test_a_member_that_lost_a_write_is_named_after_a_second_look(
    scale: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, slept = _cluster(scale, [{"m0": _g(90, 40), "m1": _g(90, 39)}], monkeypatch)
    with pytest.raises(scale.ClusterDisagrees, match=r"'m1': 39.*same applied index 90.*13766"):
        cluster.check_consistent()
    assert slept == [1.0], "the same disagreement is confirmed 1 s later before the chain stops"


def test_a_disagreement_that_resolves_is_not_reported(
    scale: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, _ = _cluster(
        scale,
        [
            {"m0": _g(90, 40), "m1": _g(90, 39)},  # a revision in flight
            {"m0": _g(91, 41), "m1": _g(91, 41)},
        ],
        monkeypatch,
    )
    cluster.check_consistent()


def test_a_member_that_never_catches_up_times_out(
    scale: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, _ = _cluster(scale, [{"m0": _g(90, 40), "m1": _g(80, 30)}], monkeypatch)
    with pytest.raises(RuntimeError, match="did not catch up within 0 s") as raised:
        cluster.check_consistent(timeout=0.0)
    assert not isinstance(raised.value, scale.ClusterDisagrees)
