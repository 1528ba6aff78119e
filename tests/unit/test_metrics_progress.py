"""Progress from metric samples (elastic_trainer.metrics.progress) and its etcd records (progress_publisher)."""

from __future__ import annotations

import json
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_trainer.launch.progress_publisher import (
    ErrorRecord,
    ProgressKeys,
    ProgressRecord,
    one_line,
)
from elastic_trainer.metrics.progress import (
    RateWindow,
    Snapshot,
    eta_seconds,
    format_duration,
    histogram_quantile,
    progress_view,
    samples_of,
    slowest_rank,
)

pytestmark = pytest.mark.timeout(60)


def node_text(
    *,
    node: str,
    ranks: dict[int, dict[str, float]],
    run: str = "job",
    target: int | None = 1000,
    world: int = 2,
    restarts: float = 0.0,
    heals: float = 0.0,
    extra: str = "",
) -> str:
    """Exposition text of one node, shaped like the launcher endpoint's."""
    lines = []
    for rank, v in ranks.items():
        labels = f'run_id="{run}",node="{node}",rank="{rank}",local_rank="{rank}"'
        lines += [
            f"elastic_trainer_step{{{labels}}} {v['step']}",
            f"elastic_trainer_samples_total{{{labels}}} {v['samples']}",
            f"elastic_trainer_loss{{{labels}}} {v.get('loss', 1.5)}",
            f"elastic_trainer_step_compute_seconds_sum{{{labels}}} {v['compute_sum']}",
            f"elastic_trainer_step_compute_seconds_count{{{labels}}} {v['step']}",
            f'elastic_trainer_step_duration_seconds_bucket{{{labels},le="0.05"}} {v.get("fast", 0)}',
            f'elastic_trainer_step_duration_seconds_bucket{{{labels},le="0.1"}} {v["step"]}',
            f'elastic_trainer_step_duration_seconds_bucket{{{labels},le="+Inf"}} {v["step"]}',
        ]
    node_labels = f'run_id="{run}",node="{node}"'
    if target is not None:
        lines.append(f"elastic_trainer_target_steps{{{node_labels}}} {target}")
    lines += [
        f"elastic_trainer_world_size{{{node_labels}}} {world}",
        f"elastic_trainer_restarts_total{{{node_labels}}} {restarts}",
        f"elastic_trainer_heals_total{{{node_labels}}} {heals}",
        f"elastic_trainer_last_step_timestamp_seconds{{{node_labels}}} 1700000100.0",
        f"elastic_trainer_last_checkpoint_step{{{node_labels}}} 100",
        f"elastic_trainer_last_checkpoint_timestamp_seconds{{{node_labels}}} 1700000000.0",
        f"elastic_trainer_learning_rate{{{node_labels}}} 0.05",
    ]
    return "\n".join(lines) + "\n" + extra


def snap(text: str, taken_at: float, run_id: str | None = None) -> Snapshot:
    return Snapshot.from_samples(
        samples_of(text_string_to_metric_families(text)), taken_at=taken_at, run_id=run_id
    )


def two_ranks(step: int, *, slow_extra: float = 0.0) -> dict[int, dict[str, float]]:
    return {
        0: {"step": step, "samples": 64 * step, "compute_sum": 0.02 * step},
        1: {"step": step, "samples": 64 * step, "compute_sum": (0.02 + slow_extra) * step},
    }


def test_snapshot_reads_every_value() -> None:
    s = snap(node_text(node="a-1", ranks=two_ranks(150), restarts=2), taken_at=5.0)
    assert (s.step, s.total_steps, s.world_size, s.samples) == (150, 1000, 2, 2 * 64 * 150)
    assert (s.last_step_unix, s.last_checkpoint_step, s.last_checkpoint_unix) == (
        1_700_000_100.0,
        100,
        1.7e9,
    )
    assert (s.loss, s.lr, s.run_ids) == (1.5, 0.05, ("job",))
    assert s.live_ranks == {("a-1", 0), ("a-1", 1)}
    assert s.nodes["a-1"].restarts == 2
    assert s.step_buckets == {0.05: 0.0, 0.1: 300.0, math.inf: 300.0}


def test_rates_eta_and_slowest_rank_over_a_window() -> None:
    window = RateWindow(span_s=30.0)
    assert (
        window.add(snap(node_text(node="a-1", ranks=two_ranks(100, slow_extra=0.01)), 0.0)) is None
    )
    later = snap(node_text(node="a-1", ranks=two_ranks(150, slow_extra=0.01)), 10.0)
    view = progress_view(later, window.add(later))
    assert view.steps_per_s == pytest.approx(5.0)
    assert view.samples_per_s == pytest.approx(2 * 64 * 5.0) and not view.samples_estimated
    assert view.eta_s == pytest.approx((1000 - 150) / 5.0)
    assert view.step_time_p50_s == pytest.approx(0.075)  # all 100 new steps in (0.05, 0.1]
    assert view.slowest is not None and (view.slowest.node, view.slowest.rank) == ("a-1", 1)
    assert view.slowest.compute_s == pytest.approx(0.03)
    assert view.slowest.vs_median == pytest.approx(0.03 / 0.025)


def test_throughput_is_scaled_from_the_ranks_one_node_sees() -> None:
    """One node of a 4-rank world: its ranks train half of each global batch."""
    first = snap(node_text(node="a-1", ranks=two_ranks(10), world=4), 0.0)
    second = snap(node_text(node="a-1", ranks=two_ranks(20), world=4), 10.0)
    view = progress_view(second, first)
    assert view.samples_per_s == pytest.approx(4 * 64 * 1.0) and view.samples_estimated


def test_two_nodes_merge_and_the_slowest_names_its_node() -> None:
    def both(step: int) -> str:
        a = node_text(
            node="a-1",
            ranks={0: {"step": step, "samples": 64 * step, "compute_sum": 0.02 * step}},
            world=2,
        )
        b = node_text(
            node="b-2",
            ranks={1: {"step": step, "samples": 64 * step, "compute_sum": 0.05 * step}},
            world=2,
            restarts=1,
        )
        return a + b

    view = progress_view(snap(both(20), 10.0), snap(both(10), 0.0))
    assert view.samples_per_s == pytest.approx(2 * 64) and not view.samples_estimated
    assert view.slowest is not None and (view.slowest.node, view.slowest.rank) == ("b-2", 1)
    assert view.restarts == 0  # rank 0's node's count (job_counts), not b-2's 1
    assert list(view.nodes) == ["a-1", "b-2"]


def test_a_step_backwards_restarts_the_window() -> None:
    """A resume from an older checkpoint: no negative or inflated rate."""
    window = RateWindow(span_s=60.0)
    window.add(snap(node_text(node="a-1", ranks=two_ranks(150)), 0.0))
    resumed = snap(node_text(node="a-1", ranks=two_ranks(125)), 10.0)
    assert window.add(resumed) is None
    view = progress_view(resumed, None)
    assert view.steps_per_s is None and view.eta_s is None and view.samples_per_s is None
    assert view.step_time_p50_s == pytest.approx(0.075)  # lifetime histogram without a baseline


def test_the_first_step_starts_the_window() -> None:
    """A baseline taken before any step (workers starting, or restarting) would hide the rate."""
    window = RateWindow(span_s=60.0)
    window.add(snap(node_text(node="a-1", ranks={}), 0.0))
    started = snap(node_text(node="a-1", ranks=two_ranks(10)), 5.0)
    assert window.add(started) is None
    later = snap(node_text(node="a-1", ranks=two_ranks(20)), 10.0)
    assert progress_view(later, window.add(later)).steps_per_s == pytest.approx(2.0)


def test_no_throughput_without_any_worker() -> None:
    empty = snap("", 0.0)
    assert progress_view(snap("", 5.0), empty).samples_per_s is None


def test_window_baseline_is_the_oldest_within_its_span() -> None:
    window = RateWindow(span_s=10.0)
    snaps = [
        snap(node_text(node="a-1", ranks=two_ranks(10 + t)), float(t)) for t in range(0, 25, 5)
    ]
    baselines = [window.add(s) for s in snaps]
    assert [b.taken_at if b else None for b in baselines] == [None, 0.0, 0.0, 5.0, 10.0]
    with pytest.raises(ValueError, match="span_s"):
        RateWindow(span_s=0)


def test_run_filter_and_several_runs() -> None:
    text = node_text(node="a-1", ranks=two_ranks(10), run="r1") + node_text(
        node="b-2", ranks=two_ranks(99), run="r2"
    )
    assert snap(text, 0.0).run_ids == ("r1", "r2")
    assert progress_view(snap(text, 0.0), None).run_id is None
    only = snap(text, 0.0, run_id="r1")
    assert (only.step, only.run_ids) == (10, ("r1",))


def test_no_training_metrics_yet() -> None:
    view = progress_view(snap("", 0.0), None)
    assert (view.step, view.total_steps, view.eta_s, view.slowest, view.restarts) == (
        None,
        None,
        None,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("step", "total", "rate", "expected"),
    [
        (100, 1000, 10.0, 90.0),
        (1000, 1000, 10.0, 0.0),
        (1200, 1000, 1.0, 0.0),
        (None, 1000, 1.0, None),
        (1, None, 1.0, None),
        (1, 10, 0.0, None),
        (1, 10, None, None),
    ],
)
def test_eta(
    step: int | None, total: int | None, rate: float | None, expected: float | None
) -> None:
    assert eta_seconds(step, total, rate) == expected


def test_histogram_quantile_matches_prometheus() -> None:
    # 10 observations <= 0.1, 10 in (0.1, 0.2]: the median is the first bucket's upper bound.
    assert histogram_quantile(0.5, {0.1: 10, 0.2: 20, math.inf: 20}) == pytest.approx(0.1)
    assert histogram_quantile(0.75, {0.1: 10, 0.2: 20, math.inf: 20}) == pytest.approx(0.15)
    assert (
        histogram_quantile(0.5, {0.1: 0, 0.2: 0, math.inf: 4}) == 0.2
    )  # all beyond the last bound
    assert histogram_quantile(0.5, {0.1: 0, math.inf: 0}) is None
    assert histogram_quantile(0.5, {0.1: 3}) is None  # no +Inf bucket: not a histogram


def test_slowest_rank_needs_two_ranks() -> None:
    assert slowest_rank({("a", 0): (1.0, 10.0)}) is None
    worst = slowest_rank({("a", 0): (1.0, 10.0), ("a", 1): (1.0, 10.0), ("b", 2): (3.0, 10.0)})
    assert worst is not None and (worst.node, worst.rank, worst.vs_median) == (
        "b",
        2,
        pytest.approx(3.0),
    )


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (math.inf, "-"),
        (-3, "0.0s"),
        (0.44, "0.4s"),
        (12.4, "12s"),
        (185, "3m05s"),
        (3720, "1h02m"),
        (3 * 86400 + 7200, "3d02h"),
    ],
)
def test_format_duration(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text


def test_progress_record_round_trips_and_reads_bad_fields_as_unknown() -> None:
    record = ProgressRecord(node="a-1", published_unix=1.7e9, step=150, total_steps=1000, world_size=2,
                            steps_per_s=5.0, samples_per_s=640.0, loss=0.5, lr=0.05, restarts=1)  # fmt: skip
    assert ProgressRecord.decode(record.encode()) == record
    data = json.loads(record.encode())
    data.update(step="150", world_size=2.5, loss=True, lr=float("nan"), extra="ignored")
    decoded = ProgressRecord.decode(json.dumps(data).encode())
    assert decoded is not None and (decoded.step, decoded.world_size, decoded.loss) == (
        None,
        None,
        None,
    )
    assert decoded.total_steps == 1000
    for raw in (
        None,
        b"",
        b"not json",
        b"\xff",
        b"[1]",
        b'{"node": "a"}',
        b'{"published_unix": 1}',
    ):
        assert ProgressRecord.decode(raw) is None


def test_error_record_round_trips() -> None:
    record = ErrorRecord(node="a-1", text="worker rank 1 exited with signal 9", unix=1.7e9)
    assert ErrorRecord.decode(record.encode()) == record
    assert ErrorRecord.decode(b'{"node": "a", "text": 5, "unix": 1}') is None


def test_one_line() -> None:
    assert (
        one_line("\n\n  Traceback (most recent call last):\n  x\n")
        == "Traceback (most recent call last):"
    )
    assert one_line("x" * 500, limit=10) == "xxxxxxx..."
    assert one_line("") == ""


def test_progress_keys_live_next_to_the_rendezvous() -> None:
    keys = ProgressKeys("/elastic-trainer/rdzv/", "job-1")
    assert (keys.state, keys.error) == ("/elastic-trainer/rdzv/job-1/progress/state",
                                        "/elastic-trainer/rdzv/job-1/progress/error")  # fmt: skip
    with pytest.raises(ValueError, match="run_id"):
        ProgressKeys("/x", "")
