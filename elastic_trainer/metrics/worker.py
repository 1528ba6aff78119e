"""Prometheus metrics of a worker process: :class:`PrometheusObserver` and its labels.

Workers write through prometheus-client's multiprocess mode into the directory the launcher
serves (:mod:`elastic_trainer.launch.node_metrics`), so a worker needs no port and its counters
outlive it. Per-step values are gathered in plain Python and written once a second
(:data:`DEFAULT_FLUSH_INTERVAL_S`). Every callback runs on the training thread and never waits
for other ranks or the GPU. Metric names, gauge modes, the straggler signal and why:
``docs/design/metrics.md``.

In a training script started by ``elastic-trainer run``::

    from elastic_trainer.metrics.worker import worker_observer
    observer = worker_observer()        # reads RANK, LOCAL_RANK, TORCHELASTIC_RUN_ID, ...
    observer.wrap_ddp(ddp_model)        # allreduce timing
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from torch import distributed as dist

from elastic_trainer.metrics.bucket_trace import BucketTiming, TracedBucketTimer, exposed_wait_s
from elastic_trainer.metrics.collective_trace import trace_environment
from elastic_trainer.metrics.ddp_stats import DEFAULT_SAMPLE_EVERY, DdpSample, SampledDdpTimer
from elastic_trainer.metrics.node_name import worker_node_name
from elastic_trainer.metrics.prometheus_compat import histogram_parts, multiprocess_values
from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.runtime.settings import (
    ENV_METRICS_ALLREDUCE,
    ENV_MULTIPROC_DIR,
    WorkerSettings,
)

__all__ = ["MetricsError", "PrometheusObserver", "WorkerLabels", "worker_observer"]


class MetricsError(ConfigError):
    """Metrics cannot be set up as asked; the message says why (one line, no restart fixes it)."""


log = logging.getLogger(__name__)

PREFIX = "elastic_trainer_"
# Histogram buckets, in base units, roughly x2 apart (see docs/design/metrics.md).
STEP_SECONDS_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0,
)  # fmt: skip
DATA_WAIT_SECONDS_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip
ALLREDUCE_SECONDS_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
    1.0, 2.0, 5.0, 10.0,
)  # fmt: skip
BUCKET_BYTES_BUCKETS = tuple(float(1024 * 4**i) for i in range(11))  # 1 KiB .. 1 GiB
CHECKPOINT_SECONDS_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

DEFAULT_FLUSH_INTERVAL_S = 1.0
"""Seconds between writes of the per-step values to the multiprocess files (see
:class:`PrometheusObserver`): well under Prometheus' scrape interval."""

# Steps whose step time waits for their allreduce timings (CUDA events finish after the host
# moved on). Bounded so a model without DDP cannot grow it.
_RECENT_STEPS = 16

MAX_DEFERRED_STEPS = 64
"""Steps :meth:`PrometheusObserver.on_step` gathers at most before it flushes, whatever the
interval: bounds the steps waiting in memory."""

_NODE_LABELS = ("run_id", "node")
_RANK_LABELS = ("run_id", "node", "rank", "local_rank")


@dataclass(kw_only=True, slots=True)
class WorkerLabels:
    """Label values of one worker process."""

    run_id: str
    """The job's rendezvous id (``TORCHELASTIC_RUN_ID``)."""
    node: str
    """The node's name, ``{short host}-{agent pid}`` (:mod:`elastic_trainer.metrics.node_name`): stable
    across worker restarts, unlike GROUP_RANK, and the name ``elastic-trainer status`` shows."""
    rank: int
    """Global rank: ``RANK`` at the start, then the process group's own at every (re)start of
    the loop (:meth:`PrometheusObserver.on_start`: a heal in place may give it another)."""
    local_rank: int
    """Rank on this node (``LOCAL_RANK``)."""

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("run_id must not be empty")
        if not self.node:
            raise ValueError("node must not be empty")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")

    @classmethod
    def from_settings(cls, settings: WorkerSettings, *, rank: int, local_rank: int) -> WorkerLabels:
        """The labels torchrun and the launcher give every worker (defaults for a plain single
        process; the node name from the launcher, else the short host name)."""
        return cls(
            run_id=settings.run_id or "none",
            node=worker_node_name(settings.node),
            rank=rank,
            local_rank=local_rank,
        )


class _LazyChild:
    """A gauge child created on its first ``set``, so that no series exists before then."""

    __slots__ = ("_child", "_parent", "_values")

    def __init__(self, parent: Gauge, values: Sequence[str]) -> None:
        self._parent = parent
        self._values = tuple(values)
        self._child: Any = None

    def set(self, value: float) -> None:
        if self._child is None:
            self._child = self._parent.labels(*self._values)
        self._child.set(value)

    def retire(self) -> None:
        """NaN in the series, if it exists (:meth:`_WorkerMetrics.retire_rank`)."""
        if self._child is not None:
            self._child.set(math.nan)


class _Metric:
    """Makes one worker's metric children in ``registry``: by rank (four label values) or by node.

    Each metric is registered once; asked again (new label values after a rank change), it
    gives the same metric's child for those values."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._made: dict[str, Any] = {}

    def _parent(self, kind: Any, name: str, doc: str, values: Sequence[str], **kwargs: Any) -> Any:
        parent = self._made.get(name)
        if parent is None:
            names = _RANK_LABELS if len(values) == 4 else _NODE_LABELS
            parent = kind(PREFIX + name, doc, names, registry=self.registry, **kwargs)
            self._made[name] = parent
        return parent

    def counter(self, name: str, doc: str, values: Sequence[str]) -> Any:
        return self._parent(Counter, name, doc, values).labels(*values)

    def histogram(
        self, name: str, doc: str, values: Sequence[str], buckets: Sequence[float]
    ) -> Any:
        return self._parent(Histogram, name, doc, values, buckets=buckets).labels(*values)

    def gauge(
        self, name: str, doc: str, values: Sequence[str], mode: str, lazy: bool = False
    ) -> Any:
        parent = self._parent(Gauge, name, doc, values, multiprocess_mode=mode)
        return _LazyChild(parent, values) if lazy else parent.labels(*values)


class _WorkerMetrics:
    """The metric objects of one worker, bound to its labels."""

    def __init__(self, metric: _Metric, labels: WorkerLabels) -> None:
        node = (labels.run_id, labels.node)
        rank = (*node, str(labels.rank), str(labels.local_rank))
        self._step_metrics(metric, node, rank)
        self._allreduce_metrics(metric, node, rank)
        self.world_size = metric.gauge(
            "world_size", "Ranks in the current world.", node, "livemostrecent"
        )
        self._checkpoint_metrics(metric, node, rank)

    def _step_metrics(self, metric: _Metric, node: Sequence[str], rank: Sequence[str]) -> None:
        counter, histogram, gauge = metric.counter, metric.histogram, metric.gauge
        self.samples = counter("samples", "Samples this rank trained on.", rank)
        self.tokens = counter("tokens", "Tokens this rank trained on.", rank)
        self.step_duration = histogram(
            "step_duration_seconds", "Wall time of one optimizer step.", rank, STEP_SECONDS_BUCKETS
        )
        self.data_wait = histogram(
            "data_wait_seconds",
            "Time a step waited for its batch from the data loader.",
            rank,
            DATA_WAIT_SECONDS_BUCKETS,
        )
        self.step_compute = histogram(
            "step_compute_seconds",
            "Step time minus the allreduce wait after the last gradient bucket's launch: the "
            "time this rank did not wait for peers (compare across ranks to find stragglers).",
            rank,
            STEP_SECONDS_BUCKETS,
        )
        # Lazy: no series before the first value (a 0 would read as "done", "1970" or, after a
        # resume, as a step backwards).
        self.step = gauge(
            "step", "Last optimizer step this rank finished.", rank, "livemostrecent", lazy=True
        )
        self.target_steps = gauge(
            "target_steps",
            "Optimizer steps the job trains for in all (max_steps, or epochs x steps per epoch).",
            node,
            "mostrecent",
            lazy=True,
        )
        self.last_step_time = gauge(
            "last_step_timestamp_seconds",
            "Unix time the last optimizer step finished on this node (time() minus it grows "
            "while training hangs or restarts).",
            node,
            "max",
            lazy=True,
        )
        self.loss = gauge("loss", "Training loss of this rank's last step.", rank, "livemostrecent")
        self.learning_rate = gauge(
            "learning_rate",
            "Learning rate of the last optimizer step (first parameter group).",
            node,
            "livemostrecent",
            lazy=True,
        )

    def _allreduce_metrics(self, metric: _Metric, node: Sequence[str], rank: Sequence[str]) -> None:
        counter, histogram, gauge = metric.counter, metric.histogram, metric.gauge
        self.allreduce_duration = histogram(
            "allreduce_duration_seconds",
            "Allreduce time of DDP's gradient buckets: one sampled backward's span, all buckets "
            "(sampled), or one bucket on the device (trace).",
            rank,
            ALLREDUCE_SECONDS_BUCKETS,
        )
        self.allreduce_bucket_bytes = histogram(
            "allreduce_bucket_bytes",
            "Size of each allreduced gradient bucket.",
            rank,
            BUCKET_BYTES_BUCKETS,
        )
        self.allreduce_bytes = counter("allreduce_bytes", "Gradient bytes allreduced.", rank)
        self.allreduce_busbw = gauge(
            "allreduce_bus_bandwidth_bytes_per_second",
            "Effective allreduce bus bandwidth of the last step's buckets, as nccl-tests "
            "defines it: 2*(n-1)/n * bytes / time.",
            rank,
            "livemostrecent",
        )

    def _checkpoint_metrics(
        self, metric: _Metric, node: Sequence[str], rank: Sequence[str]
    ) -> None:
        counter, histogram, gauge = metric.counter, metric.histogram, metric.gauge
        self.checkpoint_save_duration = histogram(
            "checkpoint_save_duration_seconds",
            "Training stall to write one checkpoint.",
            node,
            CHECKPOINT_SECONDS_BUCKETS,
        )
        self.checkpoint_load_duration = histogram(
            "checkpoint_load_duration_seconds",
            "Time to restore one checkpoint.",
            rank,
            CHECKPOINT_SECONDS_BUCKETS,
        )
        self.checkpoint_saved_bytes = counter(
            "checkpoint_saved_bytes", "Bytes written to checkpoints.", node
        )
        self.checkpoint_loaded_bytes = counter(
            "checkpoint_loaded_bytes", "Bytes restored from checkpoints.", rank
        )
        # No series before the first checkpoint: a 0 would read as a checkpoint in 1970.
        self.last_checkpoint_step = gauge(
            "last_checkpoint_step",
            "Step of the newest checkpoint saved or loaded.",
            node,
            "max",
            lazy=True,
        )
        self.last_checkpoint_time = gauge(
            "last_checkpoint_timestamp_seconds",
            "Unix time the newest checkpoint was saved.",
            node,
            "max",
            lazy=True,
        )

    def retire_rank(self) -> None:
        """This process holds another rank now: the old rank's ``step`` reads NaN, so that no
        reader takes the old rank as live (:class:`~elastic_trainer.metrics.progress.Snapshot`
        skips it, as PromQL's ``max`` does). prometheus-client cannot remove a series in
        multiprocess mode; the series goes with the process. The old rank's loss and bandwidth
        keep their last values (a NaN would turn a dashboard's ``avg`` into NaN; the snapshot
        reads the loss of live ranks only); counters and histograms keep their totals."""
        self.step.retire()


class _LocalHistogram:
    """A histogram child's observations, kept in plain Python until :meth:`flush` writes them.

    prometheus-client keeps one value per bucket (non-cumulative) plus ``_sum``, each ``observe``
    a locked write of two of them. Here an observation is a bisect and two additions; a flush
    adds the gathered counts to the same values, so the exported series are exactly what
    ``observe`` would have written.
    """

    __slots__ = ("_bounds", "_buckets", "_sum", "counts", "total")

    def __init__(self, child: Any) -> None:
        parts = histogram_parts(child)
        if parts is None:
            raise MetricsError(
                "this prometheus_client's Histogram lacks _upper_bounds/_buckets/_sum; "
                "elastic_trainer.metrics.worker needs prometheus-client >= 0.17"
            )
        bounds, buckets, total = parts
        self._bounds = tuple(bounds)  # ends with +Inf, so every number finds a bucket
        self._buckets = buckets
        self._sum = total
        self.counts = [0] * len(self._bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, i.e. Prometheus' "le" (value <= bound).
        self.counts[bisect_left(self._bounds, value)] += 1
        self.total += value

    def flush(self) -> None:
        counts = self.counts
        if not any(counts):
            return
        self._sum.inc(self.total)
        self.total = 0.0
        for i, count in enumerate(counts):
            if count:
                self._buckets[i].inc(count)
                counts[i] = 0


class PrometheusObserver:
    """A :class:`~elastic_trainer.runtime.observer.TrainingObserver` recording into prometheus-client.

    Per-step values are written to prometheus-client at most every ``flush_interval_s`` (by the
    first ``on_step`` after it elapsed) and at once by checkpoint events and :meth:`flush`; a
    worker killed by SIGKILL loses its last interval of counts. :func:`worker_observer` flushes
    at exit.

    Args:
        labels: this worker's label values.
        registry: where the metrics are registered (tests inject their own).
        wall_clock: unix time source for checkpoint timestamps (injectable for tests).
        time_allreduce: time the DDP model's bucket allreduces from :meth:`wrap_ddp` on.
            By default from DDP's own sampled runtime statistics (no comm hook,
            :mod:`elastic_trainer.metrics.ddp_stats`).
        trace_allreduce: time them through the flight recorder instead (CUDA models; a CPU model
            falls back to the sampled statistics; see ``ELASTIC_TRAINER_METRICS_ALLREDUCE``).
        ring_entries: the flight recorder's ring size (``trace``).
        flush_interval_s: seconds between writes of the per-step values; 0 writes every step.
        clock: monotonic clock for the flush interval (injectable for tests).
        group_rank: this process's rank in its process group, ``None`` without one (read at
            every :meth:`on_start`; injectable for tests).

    Raises:
        ValueError: ``flush_interval_s`` is negative.
    """

    def __init__(
        self,
        *,
        labels: WorkerLabels,
        registry: CollectorRegistry | None = None,
        wall_clock: Callable[[], float] = time.time,
        time_allreduce: bool = True,
        trace_allreduce: bool = False,
        ring_entries: int | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        group_rank: Callable[[], int | None] | None = None,
    ) -> None:
        if not flush_interval_s >= 0:
            raise ValueError(f"flush_interval_s must be >= 0, got {flush_interval_s}")
        self.labels = labels
        self.time_allreduce = time_allreduce
        self.trace_allreduce = trace_allreduce
        self.ring_entries = ring_entries
        self.flush_interval_s = flush_interval_s
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._metric = _Metric(self.registry)
        self._m = _WorkerMetrics(self._metric, labels)
        self._wall_clock = wall_clock
        self._clock = clock
        self._group_rank = group_rank if group_rank is not None else process_group_rank
        self._next_flush = -math.inf
        self._world_size = 1
        self._timer: TracedBucketTimer | None = None  # set by wrap_ddp (trace)
        self._sampler: SampledDdpTimer | None = None  # set by wrap_ddp instead (the default)
        # Steps not absorbed yet: (step, duration, data wait, samples, tokens, loss, the timer's
        # step number when the step was reported).
        self._steps: list[tuple[int, float, float, int, int, float | None, int]] = []
        # The timer's number of the next step to report that ran a synchronised backward: the
        # k-th such step (from 0) is the one whose buckets the timer numbered k.
        self._expect = 0
        self._step_durations: dict[int, float] = {}  # trace: step -> step duration
        self._pending: dict[int, list[BucketTiming]] = {}  # trace: step -> its bucket timings
        # Per-step values not yet written: histograms, counter increments, last gauge values.
        self._bind_histograms()
        self._samples = 0
        self._tokens = 0
        self._allreduce_bytes = 0
        self._step: int | None = None
        self._loss: float | None = None
        self._lr: float | None = None
        self._last_step_at: float | None = None  # monotonic time of the last reported step
        self._busbw: float | None = None
        self._told_trace_fallback = False

    def on_start(
        self, *, world_size: int, restart_count: int, total_steps: int | None = None
    ) -> None:
        """See :class:`~elastic_trainer.runtime.observer.TrainingObserver`.

        ``restart_count`` is not exported: the agent counts restarts
        (``elastic_trainer_restarts_total``), failures and membership changes alike. The rank
        label follows the process group's rank (:meth:`relabel`): a heal in place, or a joiner
        whose ``RANK`` is its own launcher's, may give this process another rank."""
        rank = self._group_rank()
        if rank is not None and rank != self.labels.rank:
            self.relabel(rank)
        self._world_size = world_size
        self._m.world_size.set(world_size)
        if total_steps is not None:
            self._m.target_steps.set(total_steps)

    def relabel(self, rank: int) -> None:
        """Write this worker's per-rank series under ``rank`` from now on. What was gathered is
        written under the old rank first; the old rank's step then reads NaN
        (:meth:`_WorkerMetrics.retire_rank`), so no reader counts the old rank as live.

        Raises:
            ValueError: ``rank`` is negative."""
        self.flush()
        old = self._m
        self.labels = dataclasses.replace(self.labels, rank=rank)
        self._m = _WorkerMetrics(self._metric, self.labels)
        old.retire_rank()
        self._bind_histograms()

    def _bind_histograms(self) -> None:
        m = self._m
        self._step_duration = _LocalHistogram(m.step_duration)
        self._data_wait = _LocalHistogram(m.data_wait)
        self._step_compute = _LocalHistogram(m.step_compute)
        self._allreduce_duration = _LocalHistogram(m.allreduce_duration)
        self._allreduce_bucket_bytes = _LocalHistogram(m.allreduce_bucket_bytes)
        self._histograms = (
            self._step_duration, self._data_wait, self._step_compute,
            self._allreduce_duration, self._allreduce_bucket_bytes,
        )  # fmt: skip

    def on_step(
        self,
        *,
        step: int,
        duration_s: float,
        data_wait_s: float,
        samples: int,
        tokens: int,
        loss: float | None,
        lr: float | None = None,
    ) -> None:
        """See :class:`~elastic_trainer.runtime.observer.TrainingObserver`.

        Only appends the step to a list; the next :meth:`flush` (at most ``flush_interval_s`` or
        :data:`MAX_DEFERRED_STEPS` steps later) turns the gathered steps into samples at once."""
        timer = self._timer
        steps = self._steps
        steps.append((step, duration_s, data_wait_s, samples, tokens, loss,
                      -1 if timer is None else timer.step_seq))  # fmt: skip
        now = self._clock()
        self._last_step_at = now
        if lr is not None:
            self._lr = lr
        if len(steps) >= MAX_DEFERRED_STEPS or now >= self._next_flush:
            self.flush()
            self._next_flush = now + self.flush_interval_s

    def on_priming(self, *, backward_passes: int) -> None:
        """See :class:`~elastic_trainer.runtime.observer.TrainingObserver`. The passes' bucket timings
        still count as allreduces; the next step reported is paired with the timer's step after
        them, not with a priming pass."""
        if backward_passes < 0:
            raise ValueError(f"backward_passes must be >= 0, got {backward_passes}")
        if self._timer is None or not backward_passes:
            return
        self._absorb_steps()  # steps reported before the passes keep their own numbers
        self._expect += backward_passes

    def _absorb_steps(self) -> None:
        """Turn the steps gathered by :meth:`on_step` into local histogram and counter values."""
        steps = self._steps
        if steps:
            self._steps = []
        timer = self._timer
        sampler = self._sampler
        exposed: float | None = None
        step_bytes = 0
        if sampler is not None:
            sample = sampler.poll()
            if sample is not None:
                self._absorb_sample(sample)
            if sampler.latest is not None:
                exposed, step_bytes = sampler.latest.exposed_s, sum(sampler.latest.bucket_bytes)
        if timer is not None:
            # Every bucket timing first: the runtime may report a step after the next step's
            # backward, so its timings may come out together with later steps'.
            self._absorb_timings(timer.drain())
        expect = self._expect
        compute = self._step_compute
        for step, duration_s, data_wait_s, samples, tokens, loss, step_seq in steps:
            self._samples += samples
            self._tokens += tokens
            self._step_duration.observe(duration_s)
            self._data_wait.observe(data_wait_s)
            self._step = step
            if loss is not None and math.isfinite(loss):
                self._loss = loss
            if exposed is not None:
                # Sampled: the newest sample's exposed wait stands for this step's (an estimate).
                compute.observe(duration_s - exposed if duration_s > exposed else 0.0)
                self._allreduce_bytes += step_bytes
            elif step_seq <= expect:
                # No timer, or no synchronised backward since the last reported step (all
                # no_sync; exact for a step reported before the next one's backward): no wait.
                compute.observe(duration_s)
            else:
                self._step_durations[expect] = duration_s  # paired once its timings are in
                expect += 1
        self._expect = expect
        if timer is not None:
            self._pair_traced_steps()

    def _add_allreduce(self, total_bytes: int, total_s: float) -> None:
        self._allreduce_bytes += total_bytes
        n = self._world_size
        if total_s > 0 and n > 1:
            self._busbw = 2.0 * (n - 1) / n * total_bytes / total_s

    def _absorb_sample(self, sample: DdpSample) -> None:
        """One backward DDP timed: its allreduce span (all buckets, first launch to last end)."""
        self._allreduce_duration.observe(sample.comm_s)
        for nbytes in sample.bucket_bytes:
            self._allreduce_bucket_bytes.observe(nbytes)
        n = self._world_size
        if sample.comm_s > 0 and n > 1:
            self._busbw = 2.0 * (n - 1) / n * sum(sample.bucket_bytes) / sample.comm_s

    def _absorb_timings(self, timings: list[BucketTiming]) -> None:
        total_bytes = 0
        total_s = 0.0
        for t in timings:
            self._allreduce_duration.observe(t.duration_s)
            self._allreduce_bucket_bytes.observe(t.nbytes)
            total_bytes += t.nbytes
            total_s += t.duration_s
            self._pending.setdefault(t.step_seq, []).append(t)
        self._add_allreduce(total_bytes, total_s)

    def _pair_traced_steps(self) -> None:
        # Collectives finish in launch order: a step's buckets are all in once a later step's
        # first bucket finished.
        complete_upto = max(self._pending, default=-1) - 1
        for seq in sorted(self._pending):
            if seq > complete_upto:
                break
            group = self._pending.pop(seq)
            duration = self._step_durations.pop(seq, None)
            if duration is not None:
                self._step_compute.observe(max(0.0, duration - exposed_wait_s(group)))
        oldest = self._expect - 1 - _RECENT_STEPS
        for seq in [s for s in self._step_durations if s <= oldest]:
            del self._step_durations[seq]
        for seq in [s for s in self._pending if s <= oldest]:
            del self._pending[seq]

    def flush(self) -> None:
        """Write the per-step values gathered since the last flush to prometheus-client."""
        self._absorb_steps()
        m = self._m
        for histogram in self._histograms:
            histogram.flush()
        if self._samples:
            m.samples.inc(self._samples)
            self._samples = 0
        if self._tokens:
            m.tokens.inc(self._tokens)
            self._tokens = 0
        if self._allreduce_bytes:
            m.allreduce_bytes.inc(self._allreduce_bytes)
            self._allreduce_bytes = 0
        if self._step is not None:
            m.step.set(self._step)
            self._step = None
        if self._loss is not None:
            m.loss.set(self._loss)
            self._loss = None
        if self._lr is not None:
            if math.isfinite(self._lr):
                m.learning_rate.set(self._lr)
            self._lr = None
        if self._last_step_at is not None:
            # The step's wall time, from the monotonic time kept per step (one clock read per step).
            m.last_step_time.set(self._wall_clock() - max(0.0, self._clock() - self._last_step_at))
            self._last_step_at = None
        if self._busbw is not None:
            m.allreduce_busbw.set(self._busbw)
            self._busbw = None

    def on_checkpoint_saved(self, *, step: int, duration_s: float, nbytes: int) -> None:
        """See :class:`~elastic_trainer.runtime.observer.TrainingObserver`."""
        m = self._m
        m.checkpoint_save_duration.observe(duration_s)
        m.checkpoint_saved_bytes.inc(nbytes)
        m.last_checkpoint_step.set(step)
        m.last_checkpoint_time.set(self._wall_clock())
        self.flush()  # the step gauges agree with the newest checkpoint

    def on_checkpoint_loaded(self, *, step: int, duration_s: float, nbytes: int) -> None:
        """See :class:`~elastic_trainer.runtime.observer.TrainingObserver`."""
        m = self._m
        m.checkpoint_load_duration.observe(duration_s)
        m.checkpoint_loaded_bytes.inc(nbytes)
        m.last_checkpoint_step.set(step)
        self.flush()

    def wrap_ddp(self, ddp_model: Any) -> None:
        """Time the model's bucket allreduces: by default from DDP's sampled runtime statistics
        (:class:`SampledDdpTimer`); with ``trace_allreduce`` and a CUDA model from the flight
        recorder (:class:`TracedBucketTimer`; a CPU model falls back to the sampled statistics,
        logged once). Neither registers a communication hook: DDP's buckets stay in C++.

        Does nothing when the observer was built with ``time_allreduce=False``.
        """
        if not self.time_allreduce:
            return
        device_ids = getattr(ddp_model, "device_ids", None)
        use_cuda = bool(device_ids) or _params_on_cuda(ddp_model)
        if self.trace_allreduce and use_cuda:
            self.attach_timer(TracedBucketTimer(ddp_model, ring_entries=self.ring_entries))
            return
        if self.trace_allreduce and not self._told_trace_fallback:
            self._told_trace_fallback = True
            log.warning("%s=trace times NCCL collectives only; this model is on the CPU, so its "
                        "allreduces are timed as in the sampled mode", ENV_METRICS_ALLREDUCE)  # fmt: skip
        self.attach_sampler(
            SampledDdpTimer(ddp_model, sample_every=None if use_cuda else DEFAULT_SAMPLE_EVERY)
        )

    def attach_timer(self, timer: TracedBucketTimer | None) -> None:
        """Read bucket timings from ``timer`` from now on (:meth:`wrap_ddp` makes it; tests too)."""
        # A new model's timer numbers its backward passes from 0: what was reported for the
        # previous one is absorbed under the old numbers, its unpaired timings are dropped.
        self._absorb_steps()
        if self._timer is not None:
            self._timer.remove()
        self._sampler = None
        self._expect = 0
        self._step_durations.clear()
        self._pending.clear()
        self._timer = timer

    def attach_sampler(self, sampler: SampledDdpTimer) -> None:
        """Read DDP's sampled statistics through ``sampler`` from now on (instead of a timer)."""
        self.attach_timer(None)
        self._sampler = sampler


def process_group_rank() -> int | None:
    """This process's rank in the default process group; ``None`` before there is one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


def _params_on_cuda(model: Any) -> bool:
    for param in model.parameters():
        return bool(param.is_cuda)
    return False


_process_observer: tuple[int, PrometheusObserver] | None = None


def worker_observer(
    settings: WorkerSettings | None = None,
    *,
    rank: int | None = None,
    local_rank: int | None = None,
) -> PrometheusObserver:
    """The metrics observer of this worker process, created on first use.

    One per process: two observers writing the same multiprocess file would overwrite each
    other's counters. ``settings`` (default: parsed from the environment) give the labels and
    the allreduce timing mode; ``trace`` turns the flight recorder on in this process's
    environment, so call this before the process group is created. ``rank``/``local_rank``
    default to torchrun's ``RANK``/``LOCAL_RANK``.

    Raises:
        MetricsError: ``PROMETHEUS_MULTIPROC_DIR`` is unset, not a directory, or was set only
            after prometheus-client was imported, so nothing would reach the node endpoint.
    """
    global _process_observer
    if _process_observer is not None and _process_observer[0] == os.getpid():
        return _process_observer[1]
    settings = settings if settings is not None else WorkerSettings.from_environ()
    directory = settings.metrics_dir or ""
    if not directory:
        raise MetricsError(
            f"worker metrics need {ENV_MULTIPROC_DIR}: start the job with `elastic-trainer run` "
            "(its launcher creates the directory and serves it) or unset ELASTIC_TRAINER_METRICS"
        )
    if not os.path.isdir(directory):
        raise MetricsError(f"{ENV_MULTIPROC_DIR}={directory} is not a directory")
    if not multiprocess_values():
        raise MetricsError(
            f"prometheus_client was imported before {ENV_MULTIPROC_DIR} was set, so this "
            "process would keep its metrics in memory; set it in the environment before Python "
            "starts"
        )
    mode = settings.metrics_allreduce
    if mode == "trace":
        trace_environment(os.environ)  # before the process group: the recorder reads its size once
    rank = settings.rank if rank is None else rank
    local_rank = settings.local_rank if local_rank is None else local_rank
    labels = WorkerLabels.from_settings(settings, rank=rank, local_rank=local_rank)
    observer = PrometheusObserver(
        labels=labels,
        time_allreduce=mode != "off",
        trace_allreduce=mode == "trace",
        ring_entries=settings.fr_buffer_entries,
    )
    _process_observer = (os.getpid(), observer)
    atexit.register(observer.flush)  # the last interval's steps (a SIGKILL still loses them)
    log.debug("worker metrics for rank %d write to %s", observer.labels.rank, directory)
    return observer
