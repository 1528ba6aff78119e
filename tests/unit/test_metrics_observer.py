"""PrometheusObserver: values read back from an injected registry."""

from __future__ import annotations

import math
import socket

import pytest
from prometheus_client import CollectorRegistry

from elastic_trainer.metrics import worker as metrics_mod
from elastic_trainer.metrics.allreduce_hook import AllreduceTimer, _PendingCuda
from elastic_trainer.metrics.worker import (
    MetricsError,
    PrometheusObserver,
    WorkerLabels,
    worker_observer,
)
from elastic_trainer.runtime.observer import TrainingObserver
from elastic_trainer.runtime.settings import WorkerSettings
from tests.unit.test_metrics_comm_hook import FakeEvent

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
        sample_allreduce=False,
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
    observer = PrometheusObserver(sample_allreduce=False, labels=labels, registry=registry, flush_interval_s=10.0,
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


class FakeDDP:
    """Records the comm hook the observer registers, like DDP's register_comm_hook."""

    process_group = None
    device_ids = None

    def __init__(self) -> None:
        self.state: AllreduceTimer | None = None

    def parameters(self) -> list[object]:
        return []

    def register_comm_hook(self, state: AllreduceTimer, hook: object) -> None:
        self.state = state


def test_allreduce_timings_give_bandwidth_and_compute_time(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    ddp = FakeDDP()
    observer.wrap_ddp(ddp)
    timer = ddp.state
    assert timer is not None and not timer.use_cuda
    observer.on_start(world_size=4, restart_count=0)
    # Two buckets of step 0: the last one launched at 10.30 and finished at 10.35.
    timer.record_cpu(0, 1_000_000, launched_s=10.10, done_s=10.20)
    timer.record_cpu(0, 3_000_000, launched_s=10.30, done_s=10.35)
    timer.next_step()  # what the hook does after launching DDP's last bucket
    step(observer, 1, duration_s=0.5)
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 2
    assert value(registry, "elastic_trainer_allreduce_bytes_total") == 4_000_000
    assert value(registry, "elastic_trainer_allreduce_bucket_bytes_sum") == 4_000_000
    # nccl-tests busbw: 2*(n-1)/n * bytes / time, over the step's buckets.
    busbw = value(registry, "elastic_trainer_allreduce_bus_bandwidth_bytes_per_second")
    assert busbw == pytest.approx(2 * 3 / 4 * 4_000_000 / 0.15)
    # Compute time = step time - wait after the last launch (10.35 - 10.30).
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.45)
    # A step that launched no bucket (e.g. no_sync) still gets its compute time.
    step(observer, 2, duration_s=0.3)
    assert value(registry, "elastic_trainer_step_compute_seconds_count") == 2
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.75)


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


def cuda_timer(observer: PrometheusObserver) -> AllreduceTimer:
    """The timer the observer installs on a DDP model whose gradients live on a GPU."""
    ddp = FakeDDP()
    ddp.device_ids = [0]  # type: ignore[assignment]
    observer.wrap_ddp(ddp)
    timer = ddp.state
    assert timer is not None and timer.use_cuda
    observer.on_start(world_size=2, restart_count=0)
    return timer


def test_cuda_timings_are_taken_when_their_events_finish(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    timer = cuda_timer(observer)
    running = _PendingCuda(0, 1000, FakeEvent(True, 0.0), FakeEvent(False, 10.0))
    timer.add_cuda(running)
    timer.next_step()  # what the hook does after launching DDP's last bucket
    step(observer, 1, duration_s=0.5)  # the GPU is behind: nothing is read, nothing waits
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 0
    assert value(registry, "elastic_trainer_step_compute_seconds_count") == 0
    running.end.done = True
    timer.add_cuda(_PendingCuda(1, 1000, FakeEvent(True, 20.0), FakeEvent(True, 25.0)))
    timer.next_step()
    step(observer, 2, duration_s=0.4)
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 2
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_sum") == pytest.approx(0.015)
    # Step 1's buckets are complete once step 2's arrived: 0.5 s - its last bucket's 10 ms.
    assert value(registry, "elastic_trainer_step_compute_seconds_count") == 1
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.49)


def test_no_checkpoint_series_before_the_first_checkpoint(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    step(observer, 1)
    names = {s.name for family in registry.collect() for s in family.samples}
    assert "elastic_trainer_last_checkpoint_timestamp_seconds" not in names
    assert "elastic_trainer_last_checkpoint_step" not in names
    observer.on_checkpoint_saved(step=5, duration_s=0.1, nbytes=1)
    assert value(registry, "elastic_trainer_last_checkpoint_step", NODE) == 5


def test_allreduce_timing_can_be_turned_off(registry: CollectorRegistry) -> None:
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(
        sample_allreduce=False,
        labels=labels,
        registry=registry,
        time_allreduce=False,
        flush_interval_s=0.0,
    )
    ddp = FakeDDP()
    observer.wrap_ddp(ddp)
    assert ddp.state is None  # no hook registered
    step(observer, 1, duration_s=0.25)
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.25)


def test_per_step_values_are_written_once_per_flush_interval(registry: CollectorRegistry) -> None:
    now = [100.0]
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(
        sample_allreduce=False,
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
            sample_allreduce=False,
            labels=labels,
            registry=CollectorRegistry(),
            flush_interval_s=-1.0,
        )


def test_deferred_histograms_export_exactly_what_observe_would(registry: CollectorRegistry) -> None:
    """The local histograms write prometheus-client's own storage: the same samples as observe()."""
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(
        sample_allreduce=False, labels=labels, registry=registry, flush_interval_s=3600.0
    )
    reference = CollectorRegistry()
    direct = metrics_mod._WorkerMetrics(reference, labels)
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


def test_compute_time_pairs_each_step_with_its_own_buckets_when_reported_late(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    """The runtime reports step k after step k+1's backward (its loss allreduce overlaps that
    step): step k's compute time must still subtract step k's wait, not step k+1's."""
    ddp = FakeDDP()
    observer.wrap_ddp(ddp)
    timer = ddp.state
    assert timer is not None
    observer.on_start(world_size=2, restart_count=0)

    def backward(seq: int, wait: float) -> None:
        timer.record_cpu(seq, 1000, launched_s=10.0 * seq, done_s=10.0 * seq + wait)
        timer.next_step()

    backward(0, 0.010)
    backward(1, 0.200)  # step 1 waited long (a peer was slow)
    step(observer, 1, duration_s=0.5)  # reported after step 2's backward
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.49)
    backward(2, 0.030)
    step(observer, 2, duration_s=0.5)
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.49 + 0.3)
    step(observer, 3, duration_s=0.5)  # the last step: reported after its own backward
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(
        0.49 + 0.3 + 0.47
    )
    assert value(registry, "elastic_trainer_step_compute_seconds_count") == 3
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 3


class RecordingHistogram:
    """Stands in for an observer's local histogram: keeps every observed value, in order."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)

    def flush(self) -> None:
        pass


def _late_reporting_run(observer: PrometheusObserver, steps: int) -> RecordingHistogram:
    """The runtime's order: step k is reported after step k+1's backward (the last step after
    its own). Step k waits 1 ms * k after its last launch. Returns the compute times observed."""
    compute = RecordingHistogram()
    observer._step_compute = compute  # type: ignore[assignment]
    ddp = FakeDDP()
    observer.wrap_ddp(ddp)
    timer = ddp.state
    assert timer is not None
    observer.on_start(world_size=2, restart_count=0)
    for k in range(1, steps + 1):
        timer.record_cpu(k - 1, 1000, launched_s=10.0 * k, done_s=10.0 * k + 0.001 * k)
        timer.record_cpu(k - 1, 500, launched_s=10.0 * k - 1.0, done_s=10.0 * k - 0.5)
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
    eager = PrometheusObserver(
        sample_allreduce=False, labels=labels, registry=eager_registry, flush_interval_s=0.0
    )
    lazy = PrometheusObserver(sample_allreduce=False, labels=labels, registry=lazy_registry, flush_interval_s=3600.0,
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
    want = [pytest.approx(1.0 - 0.001 * k) for k in range(1, steps + 1)]
    assert eager_compute.values == want
    assert lazy_compute.values == want
    for registry in (eager_registry, lazy_registry):
        assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 2 * steps
        assert value(registry, "elastic_trainer_allreduce_bytes_total") == 1500 * steps
        assert value(registry, "elastic_trainer_step") == steps
        assert value(registry, "elastic_trainer_loss") == steps + 1
        assert value(registry, "elastic_trainer_samples_total") == 32 * steps
    assert lazy._open == {}  # nothing left behind for later steps


def test_wrapping_a_new_model_keeps_the_old_hooks_timings(registry: CollectorRegistry) -> None:
    observer = PrometheusObserver(sample_allreduce=False, labels=WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1),
                                  registry=registry, flush_interval_s=3600.0, clock=lambda: 0.0)  # fmt: skip
    old = FakeDDP()
    observer.wrap_ddp(old)
    assert old.state is not None
    old.state.record_cpu(0, 1000, launched_s=1.0, done_s=1.5)  # launched, never reported
    observer.wrap_ddp(FakeDDP())
    observer.flush()
    assert value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 1
    assert value(registry, "elastic_trainer_allreduce_bytes_total") == 1000


def test_a_long_interval_still_flushes_every_max_deferred_steps(
    registry: CollectorRegistry,
) -> None:
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(sample_allreduce=False, labels=labels, registry=registry, flush_interval_s=3600.0,
                                  clock=lambda: 0.0)  # fmt: skip
    limit = metrics_mod.MAX_DEFERRED_STEPS
    for n in range(1, limit + 1):  # the first step flushes at once, then `limit` - 1 queue
        step(observer, n)
    assert value(registry, "elastic_trainer_samples_total") == 32
    step(observer, limit + 1)  # the limit-th queued step: flushed without waiting an hour
    assert value(registry, "elastic_trainer_samples_total") == 32 * (limit + 1)
    assert value(registry, "elastic_trainer_step") == limit + 1


def test_cuda_step_without_synchronised_backward_keeps_the_pairing(
    observer: PrometheusObserver, registry: CollectorRegistry
) -> None:
    """A no_sync step between two synchronised ones gets its whole time as compute time, and the
    next step is still paired with its own events (not the skipped step's number)."""
    timer = cuda_timer(observer)
    timer.add_cuda(_PendingCuda(0, 1000, FakeEvent(True, 0.0), FakeEvent(True, 10.0)))
    timer.next_step()
    step(observer, 1, duration_s=0.5)
    step(observer, 2, duration_s=0.3)  # no backward synchronised: nothing launched
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.3)
    timer.add_cuda(_PendingCuda(1, 1000, FakeEvent(True, 20.0), FakeEvent(True, 50.0)))
    timer.next_step()
    step(observer, 3, duration_s=0.4)
    timer.add_cuda(_PendingCuda(2, 1000, FakeEvent(True, 60.0), FakeEvent(True, 61.0)))
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
    observer = PrometheusObserver(sample_allreduce=False, labels=labels, registry=registry, flush_interval_s=interval,
                                  clock=lambda: 0.0)  # fmt: skip
    ddp = FakeDDP()
    observer.wrap_ddp(ddp)
    timer = ddp.state
    assert timer is not None
    observer.on_start(world_size=2, restart_count=1)
    for seq in range(2):  # two priming passes (static_graph), each waited 0.3 s
        timer.record_cpu(seq, 1000, launched_s=float(seq), done_s=seq + 0.3)
        timer.next_step()
    observer.on_priming(backward_passes=2)
    timer.record_cpu(2, 1000, launched_s=5.0, done_s=5.01)  # step 1 waited 10 ms
    timer.next_step()
    timer.record_cpu(
        3, 1000, launched_s=6.0, done_s=6.02
    )  # step 2's backward ran before step 1's report
    timer.next_step()
    step(observer, 1, duration_s=0.5)
    step(observer, 2, duration_s=0.5)
    observer.flush()
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(0.49 + 0.48)
    assert (
        value(registry, "elastic_trainer_allreduce_duration_seconds_count") == 4
    )  # priming counts
    with pytest.raises(ValueError, match="backward_passes"):
        observer.on_priming(backward_passes=-1)


def test_a_new_ddp_model_restarts_the_step_numbering(registry: CollectorRegistry) -> None:
    """Each DDP model gets its own hook, numbering backward passes from 0: after wrapping a
    second model, its first step is paired with its own first backward."""
    labels = WorkerLabels(run_id="job", node="host-a", rank=3, local_rank=1)
    observer = PrometheusObserver(sample_allreduce=False, labels=labels, registry=registry, flush_interval_s=3600.0,
                                  clock=lambda: 0.0)  # fmt: skip
    observer.on_start(world_size=2, restart_count=0)
    for wait, model_steps in ((0.1, 3), (0.02, 1)):
        ddp = FakeDDP()
        observer.wrap_ddp(ddp)
        timer = ddp.state
        assert timer is not None
        for seq in range(model_steps):
            timer.record_cpu(seq, 1000, launched_s=float(seq), done_s=seq + wait)
            timer.next_step()
            step(observer, seq + 1, duration_s=0.5)
    observer.flush()
    assert value(registry, "elastic_trainer_step_compute_seconds_sum") == pytest.approx(
        3 * 0.4 + 0.48
    )
