"""PrometheusObserver: values read back from an injected registry."""

from __future__ import annotations

import math
import socket

import pytest
from prometheus_client import CollectorRegistry

from elastic_trainer.metrics import worker as metrics_mod
from elastic_trainer.metrics.bucket_trace import BucketTiming
from elastic_trainer.metrics.progress import Snapshot, samples_of
from elastic_trainer.metrics.worker import (
    MetricsError,
    PrometheusObserver,
    WorkerLabels,
    worker_observer,
)
from elastic_trainer.runtime.observer import TrainingObserver
from elastic_trainer.runtime.settings import WorkerSettings

pytestmark = pytest.mark.timeout(60)

RANK = {"run_id": "job", "node": "host-a", "rank": "3", "local_rank": "1"}
NODE = {"run_id": "job", "node": "host-a"}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def observer(registry: CollectorRegistry) -> PrometheusObserver:
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    # Writes every step, so that each test reads what it just reported (deferral: see below).
    return PrometheusObserver(
        labels=labels,
        registry=registry,
        wall_clock=lambda: 1_700_000_000.0,
        flush_interval_s=0.0,
    )


def value(registry: CollectorRegistry, name: str, labels: dict[str, str] = RANK) -> float | None:
    return registry.get_sample_value(name, labels)


def step(observer: PrometheusObserver, n: int, **overrides: object) -> None:
    kwargs: dict[str, object] = dict(
        step=n, duration_s=0.2, data_wait_s=0.01, samples=32, tokens=4096, loss=1.5
    )
    kwargs.update(overrides)
    observer.on_step(**kwargs)  # type: ignore[arg-type]


def test_implements_training_observer(observer: PrometheusObserver) -> None:
    typed: TrainingObserver = observer
    assert typed is observer


def test_counts_samples_tokens_and_steps(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    step(observer, 1)
    step(observer, 2, tokens=0, loss=0.5, duration_s=3.0)
    assert value(registry, "elastic_trainer_samples_total") == 64
    assert value(registry, "elastic_trainer_tokens_total") == 4096
    assert value(registry, "elastic_trainer_step_duration_seconds_count") == 2
    assert value(registry, "elastic_trainer_step_duration_seconds_sum") == pytest.approx(3.2)
    le_02 = dict(RANK, le="0.2")
    assert registry.get_sample_value("elastic_trainer_step_duration_seconds_bucket", le_02) == 1
    assert value(registry, "elastic_trainer_data_wait_seconds_sum") == pytest.approx(0.02)
    assert value(registry, "elastic_trainer_step") == 2
    assert value(registry, "elastic_trainer_loss") == 0.5


def test_non_finite_or_missing_loss_keeps_last_value(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    step(observer, 1, loss=2.0)
    step(observer, 2, loss=None)
    step(observer, 3, loss=math.nan)
    assert value(registry, "elastic_trainer_loss") == 2.0


def test_without_ddp_compute_time_is_the_step_time(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    step(observer, 1, duration_s=0.4)
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.4)


def test_start_sets_world_size_and_target_but_no_restart_count(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    observer.on_start(world_size=8, restart_count=2)
    assert value(registry, "elastic_trainer_world_size", NODE) == 8
    assert value(registry, "elastic_trainer_target_steps", NODE) is None  # unknown: no series
    # The agent counts restarts (elastic_trainer_restarts_total); workers export none.
    assert not [m.name for m in registry.collect() if "restart" in m.name]
    observer.on_start(world_size=8, restart_count=2, total_steps=5000)
    assert value(registry, "elastic_trainer_target_steps", NODE) == 5000


def test_no_step_series_before_the_first_step(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    """A 0 would read as a step backwards after a resume (and as no progress at all)."""
    observer.on_start(world_size=1, restart_count=0, total_steps=10)
    assert value(registry, "elastic_trainer_step") is None
    assert value(registry, "elastic_trainer_last_step_timestamp_seconds", NODE) is None
    assert value(registry, "elastic_trainer_learning_rate", NODE) is None
    step(observer, 7)
    assert value(registry, "elastic_trainer_step") == 7


def test_learning_rate_and_time_of_the_last_step(registry: CollectorRegistry) -> None:
    wall, mono = [1_700_000_000.0], [50.0]
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(labels=labels, registry=registry, flush_interval_s=10.0,
                                  wall_clock=lambda: wall[0], clock=lambda: mono[0])  # fmt: skip
    step(observer, 1, lr=0.1)  # the first step writes at once
    assert value(registry, "elastic_trainer_learning_rate", NODE) == 0.1
    assert value(registry, "elastic_trainer_last_step_timestamp_seconds", NODE) == 1_700_000_000.0
    mono[0] += 2.0
    wall[0] += 2.0
    step(observer, 2, lr=0.05)  # deferred: nothing written yet
    step(observer, 3, lr=None)  # the lr of step 2 stays the newest known
    assert value(registry, "elastic_trainer_learning_rate", NODE) == 0.1
    mono[0] += 3.0
    wall[0] += 3.0
    observer.flush()  # 3 s after step 3: the gauge holds step 3's time, not the flush's
    assert value(registry, "elastic_trainer_learning_rate", NODE) == 0.05
    assert value(registry, "elastic_trainer_last_step_timestamp_seconds", NODE) == 1_700_000_002.0
    step(observer, 4, lr=math.nan)  # a non-finite lr is not written
    observer.flush()
    assert value(registry, "elastic_trainer_learning_rate", NODE) == 0.05


def test_checkpoint_metrics(observer: PrometheusObserver, registry: CollectorRegistry) -> None:
    observer.on_checkpoint_loaded(step=100, duration_s=0.5, nbytes=1000)
    assert value(registry, "elastic_trainer_last_checkpoint_step", NODE) == 100
    assert value(registry, "elastic_trainer_checkpoint_loaded_bytes_total") == 1000
    assert value(registry, "elastic_trainer_checkpoint_load_duration_seconds_count") == 1
    observer.on_checkpoint_saved(step=150, duration_s=2.0, nbytes=4000)
    assert value(registry, "elastic_trainer_last_checkpoint_step", NODE) == 150
    assert value(registry, "elastic_trainer_last_checkpoint_timestamp_seconds", NODE) == 1.7e9
    assert value(registry, "elastic_trainer_checkpoint_saved_bytes_total", NODE) == 4000
    assert value(registry, "elastic_trainer_checkpoint_save_duration_seconds_sum", NODE) == 2.0


def test_worker_labels_validate_and_read_env() -> None:
    with pytest.raises(ValueError, match="rank"):
        WorkerLabels(run_id="j", node="n", rank=-1, local_rank=0)
    with pytest.raises(ValueError, match="run_id"):
        WorkerLabels(run_id="", node="n", rank=0, local_rank=0)
    settings = WorkerSettings.from_environ(
        {"RANK": "5", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "j1"}
    )
    labels = WorkerLabels.from_settings(
        settings, rank=settings.rank, local_rank=settings.local_rank
    )
    assert (labels.run_id, labels.rank, labels.local_rank) == ("j1", 5, 1)
    assert labels.node == socket.gethostname().split(".")[0]  # no launcher: the short host name
    settings = WorkerSettings.from_environ(
        {"RANK": "0", "ELASTIC_TRAINER_NODE": "node-7-4242"}
    )  # the launcher's
    assert WorkerLabels.from_settings(settings, rank=0, local_rank=0).node == "node-7-4242"
    with pytest.raises(ValueError, match="RANK"):
        WorkerSettings.from_environ({"RANK": "x"})


def test_worker_observer_refuses_without_multiproc_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setattr(metrics_mod, "_process_observer", None)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with pytest.raises(MetricsError, match="PROMETHEUS_MULTIPROC_DIR"):
        worker_observer()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path) + "/missing")
    with pytest.raises(MetricsError, match="not a directory"):
        worker_observer()
    # This test process imported prometheus_client without the variable: refused, not silent.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with pytest.raises(MetricsError, match="imported before"):
        worker_observer()


def test_no_checkpoint_series_before_the_first_checkpoint(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    step(observer, 1)
    names = {s.name for family in registry.collect() for s in family.samples}
    assert "elastic_trainer_last_checkpoint_timestamp_seconds" not in names
    assert "elastic_trainer_last_checkpoint_step" not in names
    observer.on_checkpoint_saved(step=5, duration_s=0.1, nbytes=1)
    assert value(registry, "elastic_trainer_last_checkpoint_step", NODE) == 5


def test_per_step_values_are_written_once_per_flush_interval(registry: CollectorRegistry) -> None:
    now = [100.0]
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(
        labels=labels,
        registry=registry,
        flush_interval_s=1.0,
        clock=lambda: now[0],
    )
    step(observer, 1)  # the first step writes at once
    assert value(registry, "elastic_trainer_samples_total") == 32
    now[0] += 0.5
    step(observer, 2, loss=0.25)
    step(observer, 3, loss=0.125)
    # Within the interval nothing reached prometheus-client yet.
    assert value(registry, "elastic_trainer_samples_total") == 32
    assert value(registry, "elastic_trainer_step") == 1
    assert value(registry, "elastic_trainer_step_duration_seconds_count") == 1
    now[0] += 0.5
    step(observer, 4, loss=None)  # the interval elapsed: steps 2-4 are written together
    assert value(registry, "elastic_trainer_samples_total") == 4 * 32
    assert value(registry, "elastic_trainer_tokens_total") == 4 * 4096
    assert value(registry, "elastic_trainer_step") == 4
    assert value(registry, "elastic_trainer_loss") == 0.125
    assert value(registry, "elastic_trainer_step_duration_seconds_count") == 4
    # A checkpoint writes what is pending, so the step gauge agrees with it.
    now[0] += 0.1
    step(observer, 5)
    observer.on_checkpoint_saved(step=5, duration_s=0.1, nbytes=1)
    assert value(registry, "elastic_trainer_step") == 5
    now[0] += 0.1
    step(observer, 6)
    observer.flush()
    assert value(registry, "elastic_trainer_samples_total") == 6 * 32
    with pytest.raises(ValueError, match="flush_interval_s"):
        PrometheusObserver(
            labels=labels,
            registry=CollectorRegistry(),
            flush_interval_s=-1.0,
        )


def test_deferred_histograms_export_exactly_what_observe_would(registry: CollectorRegistry) -> None:
    """The local histograms write prometheus-client's own storage: the same samples as observe()."""
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(labels=labels, registry=registry, flush_interval_s=3600.0)
    reference = CollectorRegistry()
    direct = metrics_mod._WorkerMetrics(metrics_mod._Metric(reference), labels)
    durations = [0.0, 0.001, 0.0015, 0.2, 0.2000001, 7.0, 59.9, 60.0, 1e6, -0.5]
    for n, duration in enumerate(durations, start=1):
        step(observer, n, duration_s=duration, data_wait_s=duration / 10)
        direct.step_duration.observe(duration)
        direct.data_wait.observe(duration / 10)
        direct.step_compute.observe(duration)
        direct.samples.inc(32)
        direct.tokens.inc(4096)
        if n == 1:  # the first step is written at once, then nothing for an hour
            assert value(registry, "elastic_trainer_samples_total") == 32
    observer.flush()
    observer.flush()  # idempotent: nothing pending is written twice

    def exported(reg: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in reg.collect()
            if family.name.startswith(("elastic_trainer_step_", "elastic_trainer_data_wait",
                                       "elastic_trainer_samples", "elastic_trainer_tokens"))
            for s in family.samples
            if not s.name.endswith("_created")
        }  # fmt: skip

    got, want = exported(registry), exported(reference)
    assert got.keys() == want.keys() and len(got) > 60
    for key, expected in want.items():
        assert got[key] == pytest.approx(expected, rel=1e-12, abs=1e-12), key


class RecordingHistogram:
    """Stands in for an observer's local histogram: keeps every observed value, in order."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)

    def flush(self) -> None:
        pass


def test_a_long_interval_still_flushes_every_max_deferred_steps(
    registry: CollectorRegistry,
) -> None:
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(labels=labels, registry=registry, flush_interval_s=3600.0,
                                  clock=lambda: 0.0)  # fmt: skip
    limit = metrics_mod.MAX_DEFERRED_STEPS
    for n in range(1, limit + 1):  # the first step flushes at once, then `limit` - 1 queue
        step(observer, n)
    assert value(registry, "elastic_trainer_samples_total") == 32
    step(observer, limit + 1)  # the limit-th queued step: flushed without waiting an hour
    assert value(registry, "elastic_trainer_samples_total") == 32 * (limit + 1)
    assert value(registry, "elastic_trainer_step") == limit + 1


class FakeDDP:
    """What the observer reads of a DDP model: its parameters' device and DDP's logging data.
    A comm hook registration fails the test: no allreduce mode may put one on the buckets."""

    process_group = None
    device_ids = None

    def __init__(self, logging_data: dict[str, object] | None = None) -> None:
        self.logging_data: dict[str, object] = dict(logging_data or {})
        self.sample_rate: int | None = None

    def parameters(self) -> list[object]:
        return []

    def register_comm_hook(self, state: object, hook: object) -> None:
        raise AssertionError("the observer registered a Python comm hook")

    def _get_ddp_logging_data(self) -> dict[str, object]:
        return self.logging_data

    def _set_ddp_runtime_logging_sample_rate(self, every: int) -> None:
        self.sample_rate = every


def sampled_backward(
    ddp: FakeDDP, *, start_s: float, compute_end_s: float, end_s: float, sizes: str
) -> None:
    """What DDP's reducer logs of a backward it timed (ns), as the next forward computes it."""
    ddp.logging_data.update(
        backward_comm_time_start=int(start_s * 1e9),
        backward_compute_time_end=int(compute_end_s * 1e9),
        backward_comm_time_end=int(end_s * 1e9),
        rebuilt_bucket_sizes=sizes,
        iteration=int(ddp.logging_data.get("iteration", 0) or 0) + 1,  # type: ignore[call-overload]
    )


def test_sampled_statistics_give_bandwidth_and_compute_time_without_a_hook(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    ddp = FakeDDP()
    observer.wrap_ddp(ddp)  # the default mode: DDP's own sampled timing, no hook (see FakeDDP)
    assert ddp.sample_rate == metrics_mod.DEFAULT_SAMPLE_EVERY
    observer.on_start(world_size=4, restart_count=0)
    # Two buckets; the first launched at 10.00, the computation ended at 10.30, the last
    # allreduce at 10.35.
    sampled_backward(ddp, start_s=10.0, compute_end_s=10.30, end_s=10.35, sizes="1000000, 3000000")
    step(observer, 1, duration_s=0.5)
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 1
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_sum") == pytest.approx(0.35)
    assert value(registry, "elastic_trainer_allreduce_bucket_bytes_count") == 2
    assert value(registry, "elastic_trainer_allreduce_bytes_total") == 4_000_000
    # nccl-tests busbw: 2*(n-1)/n * bytes / time, over the sampled backward's span.
    busbw = value(registry, "elastic_trainer_allreduce_bus_bandwidth_bytes_per_second")
    assert busbw == pytest.approx(2 * 3 / 4 * 4_000_000 / 0.35)
    # Compute time = step time - the exposed wait (10.35 - 10.30).
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.45)
    # A step DDP did not time: the newest sample's wait and sizes stand for it (an estimate).
    step(observer, 2, duration_s=0.3)
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 1
    assert value(registry, "elastic_trainer_allreduce_bytes_total") == 8_000_000
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.7)


def test_trace_on_a_cpu_model_falls_back_to_the_sampled_mode_and_says_so_once(
    registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(labels=labels, registry=registry, trace_allreduce=True,
                                  flush_interval_s=0.0)  # fmt: skip
    for _ in range(2):
        ddp = FakeDDP()  # on the CPU: the flight recorder times NCCL only
        with caplog.at_level("WARNING", logger=metrics_mod.__name__):
            observer.wrap_ddp(ddp)
        assert observer._timer is None and observer._sampler is not None
        assert ddp.sample_rate == metrics_mod.DEFAULT_SAMPLE_EVERY
    said = [r.getMessage() for r in caplog.records if r.name == metrics_mod.__name__]
    assert said == [
        "ELASTIC_TRAINER_METRICS_ALLREDUCE=trace times NCCL collectives only; this model is on "
        "the CPU, so its allreduces are timed as in the sampled mode"
    ]
    sampled_backward(ddp, start_s=1.0, compute_end_s=1.1, end_s=1.2, sizes="1000")
    step(observer, 1, duration_s=0.5)
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 1


def test_allreduce_timing_can_be_turned_off(registry: CollectorRegistry) -> None:
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(
        labels=labels, registry=registry, time_allreduce=False, flush_interval_s=0.0
    )
    ddp = FakeDDP()
    observer.wrap_ddp(ddp)
    assert ddp.sample_rate is None and observer._sampler is None and observer._timer is None
    sampled_backward(ddp, start_s=1.0, compute_end_s=1.1, end_s=1.2, sizes="1000")
    step(observer, 1, duration_s=0.25)
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.25)
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 0


class FakeTracedTimer:
    """What the observer reads of a :class:`~elastic_trainer.metrics.bucket_trace.TracedBucketTimer`
    (``trace``): per-bucket timings numbered by step, found only after the device ran them."""

    def __init__(self) -> None:
        self.step_seq = 0
        self.removed = False
        self._running: list[BucketTiming] = []
        self._done: list[BucketTiming] = []

    def launch(self, nbytes: int, duration_s: float, *, done: bool = True) -> None:
        """A bucket of the current backward (found in the recorder at the next drain if done)."""
        timing = BucketTiming(step_seq=self.step_seq, nbytes=nbytes, duration_s=duration_s)
        (self._done if done else self._running).append(timing)

    def next_step(self) -> None:
        self.step_seq += 1

    def finish(self) -> None:
        self._done.extend(self._running)
        self._running.clear()

    def drain(self) -> list[BucketTiming]:
        done, self._done = self._done, []
        return done

    def remove(self) -> None:
        self.removed = True


def traced(observer: PrometheusObserver, world_size: int = 2) -> FakeTracedTimer:
    timer = FakeTracedTimer()
    observer.attach_timer(timer)  # type: ignore[arg-type]
    observer.on_start(world_size=world_size, restart_count=0)
    return timer


def test_traced_timings_give_bandwidth_and_are_taken_when_the_device_ran_them(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    timer = traced(observer, world_size=4)
    timer.launch(1_000_000, 0.10, done=False)
    timer.launch(3_000_000, 0.05, done=False)
    timer.next_step()
    step(observer, 1, duration_s=0.5)  # the device is behind: nothing is read, nothing waits
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 0
    assert value(registry, "elastic_trainer_step_compute_seconds_count") == 0
    timer.finish()
    timer.launch(1000, 0.005)
    timer.next_step()
    step(observer, 2, duration_s=0.4)
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 3
    assert value(registry, "elastic_trainer_allreduce_bytes_total") == 4_001_000
    busbw = value(registry, "elastic_trainer_allreduce_bus_bandwidth_bytes_per_second")
    assert busbw == pytest.approx(2 * 3 / 4 * 4_001_000 / 0.155)
    # Step 1's buckets are complete once step 2's arrived: 0.5 s - its last bucket's 50 ms.
    assert value(registry, "elastic_trainer_step_compute_seconds_count") == 1
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.45)


def test_compute_time_pairs_each_step_with_its_own_buckets_when_reported_late(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    """The runtime reports step k after step k+1's backward (its loss allreduce overlaps that
    step): step k's compute time must still subtract step k's wait, not step k+1's."""
    timer = traced(observer)

    def backward(wait: float) -> None:
        timer.launch(1000, wait)
        timer.next_step()

    backward(0.010)
    backward(0.200)  # step 2 waited long (a peer was slow)
    step(observer, 1, duration_s=0.5)  # reported after step 2's backward
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.49)
    backward(0.030)
    step(observer, 2, duration_s=0.5)
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.49 + 0.3)
    step(observer, 3, duration_s=0.5)  # the last step: no later bucket proves it complete yet
    assert value(registry, "elastic_trainer_step_compute_seconds_count") == 2
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 3


def _late_reporting_run(observer: PrometheusObserver, steps: int) -> RecordingHistogram:
    """The runtime's order: step k is reported after step k+1's backward (the last step after
    its own). Step k's last bucket takes 1 ms * k. Returns the compute times observed."""
    compute = RecordingHistogram()
    observer._step_compute = compute  # type: ignore[assignment]
    timer = traced(observer)
    for k in range(1, steps + 1):
        timer.launch(500, 0.5)
        timer.launch(1000, 0.001 * k)
        timer.next_step()
        if k > 1:
            step(observer, k - 1, duration_s=1.0, loss=float(k))
    step(observer, steps, duration_s=1.0, loss=float(steps + 1))
    return compute


def test_deferred_steps_export_what_writing_every_step_exports() -> None:
    """on_step only queues; a flush much later pairs every step with its own buckets exactly as
    writing each step at once does: step k subtracts its own wait, no later step's."""
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    eager_registry, lazy_registry = CollectorRegistry(), CollectorRegistry()
    eager = PrometheusObserver(labels=labels, registry=eager_registry, flush_interval_s=0.0)
    lazy = PrometheusObserver(labels=labels, registry=lazy_registry, flush_interval_s=3600.0,
                              clock=lambda: 0.0)  # fmt: skip
    steps = metrics_mod.MAX_DEFERRED_STEPS - 10
    eager_compute = _late_reporting_run(eager, steps)
    lazy_compute = _late_reporting_run(lazy, steps)
    # Only the first report was written (the first on_step flushes: steps 1 and 2 had run their
    # backward, two buckets each); the rest waits.
    assert lazy_compute.values == [pytest.approx(1.0 - 0.001)]
    assert value(lazy_registry, "elastic_trainer_step_duration_seconds_count") == 1
    assert value(lazy_registry, "elastic_trainer_allreduce_duration_seconds_count") == 4
    lazy.flush()
    # Every step but the last, which no later bucket proves complete.
    want = [pytest.approx(1.0 - 0.001 * k) for k in range(1, steps)]
    assert eager_compute.values == want
    assert lazy_compute.values == want
    for registry in (eager_registry, lazy_registry):
        assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 2 * steps
        assert value(registry, "elastic_trainer_allreduce_bytes_total") == 1500 * steps
        assert value(registry, "elastic_trainer_step") == steps
        assert value(registry, "elastic_trainer_loss") == steps + 1
        assert value(registry, "elastic_trainer_samples_total") == 32 * steps
    assert list(lazy._pending) == [steps - 1]  # nothing older left behind


def test_wrapping_a_new_model_keeps_the_old_timers_timings(registry: CollectorRegistry) -> None:
    observer = PrometheusObserver(labels=WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1),
                                  registry=registry, flush_interval_s=3600.0, clock=lambda: 0.0)  # fmt: skip
    old = traced(observer)
    old.launch(1000, 0.5)  # launched, never reported
    observer.wrap_ddp(FakeDDP())
    assert old.removed  # it no longer numbers the old model's forwards
    observer.flush()
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 1
    assert value(registry, "elastic_trainer_allreduce_bytes_total") == 1000


def test_step_without_synchronised_backward_keeps_the_pairing(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    """A no_sync step between two synchronised ones gets its whole time as compute time, and the
    next step is still paired with its own buckets (not the skipped step's number)."""
    timer = traced(observer)
    timer.launch(1000, 0.010)
    timer.next_step()
    step(observer, 1, duration_s=0.5)
    step(observer, 2, duration_s=0.3)  # no backward synchronised: nothing launched
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.3)
    timer.launch(1000, 0.030)
    timer.next_step()
    step(observer, 3, duration_s=0.4)
    timer.launch(1000, 0.001)
    timer.next_step()
    step(observer, 4, duration_s=0.4)
    # Step 1: 0.5 - 10 ms; step 2: 0.3; step 3: 0.4 - its own 30 ms (not step 1's 10 ms).
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(
        0.49 + 0.3 + 0.37
    )
    assert value(registry, "elastic_trainer_step_compute_seconds_count") == 3


@pytest.mark.parametrize("interval", [0.0, 3600.0])
def test_priming_passes_are_timed_but_not_paired_with_a_step(
    registry: CollectorRegistry, interval: float
) -> None:
    """After a restart the runtime runs synchronised backward passes that belong to no step
    (bucket priming): the first real step must subtract its own wait, not a priming pass's."""
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(labels=labels, registry=registry, flush_interval_s=interval,
                                  clock=lambda: 0.0)  # fmt: skip
    timer = traced(observer)
    for _ in range(2):  # two priming passes (static_graph), each waited 0.3 s
        timer.launch(1000, 0.3)
        timer.next_step()
    observer.on_priming(backward_passes=2)
    timer.launch(1000, 0.01)  # step 1 waited 10 ms
    timer.next_step()
    timer.launch(1000, 0.02)  # step 2's backward ran before step 1's report
    timer.next_step()
    step(observer, 1, duration_s=0.5)
    step(observer, 2, duration_s=0.5)
    timer.launch(1000, 0.5)  # a later backward: step 2's buckets are all in
    observer.flush()
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.49 + 0.48)
    priming_counts = value(registry, "elastic_trainer_allreduce_duration_seconds_count")
    assert priming_counts == 5
    with pytest.raises(ValueError, match="backward_passes"):
        observer.on_priming(backward_passes=-1)


def test_a_new_ddp_model_restarts_the_step_numbering(registry: CollectorRegistry) -> None:
    """Each DDP model gets its own timer, numbering backward passes from 0: after wrapping a
    second model, its first step is paired with its own first backward."""
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(labels=labels, registry=registry, flush_interval_s=3600.0,
                                  clock=lambda: 0.0)  # fmt: skip
    for wait, model_steps in ((0.1, 3), (0.02, 2)):
        timer = traced(observer)
        for seq in range(model_steps):
            timer.launch(1000, wait)
            timer.next_step()
            step(observer, seq + 1, duration_s=0.5)
    observer.flush()
    # Each model's last step has no later bucket: model 1's steps 1-2, model 2's step 1.
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(
        2 * 0.4 + 0.48
    )


def test_a_rank_changed_at_a_heal_relabels_the_series_and_retires_the_old_step(
    registry: CollectorRegistry,
) -> None:
    """A joiner starts with its own launcher's RANK 0, then holds rank 1 in the job's group: from
    that start on its series say rank 1, and its old rank's step no longer reads as a live rank
    (issue 40: `top` said `ranks 0` where `status` said rank 1)."""
    group = [0]
    labels = WorkerLabels(run_id="job", node="host-a", rank=0, local_rank=0)
    observer = PrometheusObserver(labels=labels, registry=registry, flush_interval_s=3600.0,
                                  group_rank=lambda: group[0])  # fmt: skip
    old = {"run_id": "job", "node": "host-a", "rank": "0", "local_rank": "0"}
    new = dict(old, rank="1")
    observer.on_start(world_size=1, restart_count=0)
    for n in (1, 2, 3):
        step(observer, n, loss=9.0)  # deferred: written at the relabel, under rank 0
    group[0] = 1  # healed in place into a bigger group
    observer.on_start(world_size=2, restart_count=0)
    assert observer.labels.rank == 1
    assert value(registry, "elastic_trainer_samples_total", old) == 3 * 32
    step(observer, 4, loss=0.5)
    observer.flush()
    old_step = value(registry, "elastic_trainer_step", old)
    assert old_step is not None and math.isnan(old_step)
    assert value(registry, "elastic_trainer_step", new) == 4
    assert value(registry, "elastic_trainer_samples_total", new) == 32
    assert value(registry, "elastic_trainer_step_duration_seconds_count", new) == 1
    snapshot = Snapshot.from_samples(samples_of(registry.collect()), taken_at=0.0)
    assert snapshot.nodes["host-a"].ranks == (1,) and snapshot.live_ranks == {("host-a", 1)}
    assert snapshot.step == 4 and snapshot.loss == 0.5  # the old rank's stale loss left out
    observer.on_start(world_size=2, restart_count=0)  # the same rank again: nothing changes
    assert value(registry, "elastic_trainer_step", new) == 4


def test_the_rank_label_follows_the_process_group(gloo_world: None) -> None:
    """By default the rank is the default process group's (here rank 0 of one)."""
    registry = CollectorRegistry()
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(labels=labels, registry=registry, flush_interval_s=0.0)
    assert metrics_mod.process_group_rank() == 0
    observer.on_start(world_size=1, restart_count=0)
    step(observer, 1)
    assert observer.labels.rank == 0
    assert value(registry, "elastic_trainer_step", dict(RANK, rank="0")) == 1


def test_no_process_group_keeps_the_rank_from_the_environment(
    observer: PrometheusObserver,
) -> None:
    assert metrics_mod.process_group_rank() is None
    observer.on_start(world_size=1, restart_count=0)
    assert observer.labels.rank == 3
