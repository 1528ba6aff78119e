"""What a job's metrics say about its progress: step and target, rates, ETA, the slowest rank.

Pure functions over prometheus-client samples, wherever they come from: a node's ``/metrics``
text (:mod:`elastic_trainer.ops.top`) or the launcher's own registry
(:mod:`elastic_trainer.launch.progress_publisher`, which puts the result in etcd for
``elastic-trainer status``)::

    window = RateWindow(span_s=60.0)
    snapshot = Snapshot.from_samples(samples, taken_at=time.monotonic())
    view = progress_view(snapshot, window.add(snapshot))

Rates compare two snapshots of a window (a step moving back, a resume from an older checkpoint,
starts the window again). A node sees only its own ranks: throughput is scaled by world size over
ranks seen and marked estimated. The slowest rank has the largest mean ``step_compute`` time,
compared with the median over ranks. Metric names and the straggler signal:
``docs/design/metrics.md``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

PREFIX = "elastic_trainer_"
STEP = PREFIX + "step"
TARGET_STEPS = PREFIX + "target_steps"
WORLD_SIZE = PREFIX + "world_size"
SAMPLES = PREFIX + "samples_total"
STEP_BUCKET = PREFIX + "step_duration_seconds_bucket"
COMPUTE_SUM = PREFIX + "step_compute_seconds_sum"
COMPUTE_COUNT = PREFIX + "step_compute_seconds_count"
RESTARTS = PREFIX + "restarts_total"
HEALS = PREFIX + "heals_total"
LAST_STEP_TIME = PREFIX + "last_step_timestamp_seconds"
LAST_CHECKPOINT_STEP = PREFIX + "last_checkpoint_step"
LAST_CHECKPOINT_TIME = PREFIX + "last_checkpoint_timestamp_seconds"
LOSS = PREFIX + "loss"
LEARNING_RATE = PREFIX + "learning_rate"
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
FAMILIES = frozenset(
    next((name.removesuffix(end) for end in _SUFFIXES if name.endswith(end)), name)
    for name in (STEP, TARGET_STEPS, WORLD_SIZE, SAMPLES, STEP_BUCKET, COMPUTE_SUM, COMPUTE_COUNT,
                 RESTARTS, HEALS, LAST_STEP_TIME, LAST_CHECKPOINT_STEP, LAST_CHECKPOINT_TIME, LOSS,
                 LEARNING_RATE)
)  # fmt: skip
"""The metric families :meth:`Snapshot.from_samples` reads (a counter's name without ``_total``, a
histogram's without its suffixes): a reader that polls may read only these."""

RankId = tuple[str, int]
"""(node name, global rank)."""


class Sample(Protocol):
    """One prometheus-client sample (``prometheus_client.samples.Sample`` has these)."""

    @property
    def name(self) -> str: ...

    @property
    def labels(self) -> dict[str, str]: ...

    @property
    def value(self) -> float: ...


class MetricFamily(Protocol):
    @property
    def samples(self) -> list[Any]: ...


def samples_of(families: Iterable[MetricFamily]) -> list[Sample]:
    """Every sample of ``families`` (``registry.collect()`` or the text parser's output)."""
    return [sample for family in families for sample in family.samples]


@dataclass(kw_only=True, slots=True)
class NodeStats:
    """What one node's metrics say about that node."""

    ranks: tuple[int, ...] = ()
    """Global ranks with a live worker on the node (a live, finite ``step`` gauge: a worker whose
    rank changed at a heal writes NaN into its old rank's)."""
    restarts: float | None = None
    """``elastic_trainer_restarts_total`` of the node's agent."""
    heals: float | None = None
    """``elastic_trainer_heals_total`` of the node's launcher (in-place heals it saw)."""


@dataclass(kw_only=True, slots=True)
class Snapshot:
    """The progress-related values of one or more nodes' metrics at one moment."""

    taken_at: float
    """Monotonic time the samples were read."""
    run_ids: tuple[str, ...] = ()
    step: int | None = None
    """The last finished step: the highest of the live ranks' (ranks step in lockstep)."""
    total_steps: int | None = None
    world_size: int | None = None
    samples: float = 0.0
    """``samples_total`` summed over every rank seen, dead workers' included."""
    step_buckets: dict[float, float] = field(default_factory=dict)
    """Cumulative ``step_duration`` bucket counts summed over ranks, by upper bound."""
    compute: dict[RankId, tuple[float, float]] = field(default_factory=dict)
    """Per rank: ``step_compute`` (sum, count)."""
    nodes: dict[str, NodeStats] = field(default_factory=dict)
    last_step_unix: float | None = None
    last_checkpoint_step: int | None = None
    last_checkpoint_unix: float | None = None
    loss: float | None = None
    """Mean over the live ranks (the runtime reports the global mean loss on every rank); a rank
    with no live ``step`` (a worker that holds another rank since a heal) is left out."""
    lr: float | None = None

    @property
    def live_ranks(self) -> set[RankId]:
        return {(node, rank) for node, stats in self.nodes.items() for rank in stats.ranks}

    @classmethod
    def from_samples(
        cls, samples: Iterable[Sample], *, taken_at: float, run_id: str | None = None
    ) -> Snapshot:
        """Read the values from ``samples``; with ``run_id``, only that run's series."""
        snap = cls(taken_at=taken_at)
        runs: set[str] = set()
        steps: dict[RankId, float] = {}
        losses: dict[RankId, float] = {}
        per_rank: dict[str, dict[RankId, float]] = {COMPUTE_SUM: {}, COMPUTE_COUNT: {}}
        per_node: dict[str, dict[str, float]] = {RESTARTS: {}, HEALS: {}}
        for sample in samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            run = labels.get("run_id")
            if not name.startswith(PREFIX) or (run is not None and run_id not in (None, run)):
                continue
            if run is not None:
                runs.add(run)
            node, rank = labels.get("node", "?"), _rank(labels)
            if name == STEP and rank is not None:
                if math.isfinite(value):  # NaN: a rank this worker no longer holds (a heal)
                    steps[(node, rank)] = value
            elif name in per_rank and rank is not None:
                per_rank[name][(node, rank)] = per_rank[name].get((node, rank), 0.0) + value
            elif name in per_node:
                per_node[name][node] = per_node[name].get(node, 0.0) + value
            elif name == LOSS and rank is not None and math.isfinite(value):
                losses[(node, rank)] = value
            else:
                snap._take(name, labels, value)
        snap.run_ids = tuple(sorted(runs))
        if steps:
            snap.step = int(max(steps.values()))
        live_losses = [loss for rank_id, loss in losses.items() if rank_id in steps]
        snap.loss = statistics.fmean(live_losses) if live_losses else None
        compute_sum, compute_count = per_rank[COMPUTE_SUM], per_rank[COMPUTE_COUNT]
        snap.compute = {r: (compute_sum[r], compute_count.get(r, 0.0)) for r in compute_sum}
        restarts, heals = per_node[RESTARTS], per_node[HEALS]
        for node in sorted({n for n, _ in steps} | set(restarts) | set(heals)):
            snap.nodes[node] = NodeStats(ranks=tuple(sorted(r for n, r in steps if n == node)),
                                         restarts=restarts.get(node), heals=heals.get(node))  # fmt: skip
        return snap

    def _take(self, name: str, labels: dict[str, str], value: float) -> None:
        """Fold in one sample of a value of the whole job (samples, buckets, the highest of)."""
        if name == SAMPLES:
            self.samples += value
        elif name == STEP_BUCKET:
            bound = _bound(labels.get("le"))
            if bound is not None:
                self.step_buckets[bound] = self.step_buckets.get(bound, 0.0) + value
        elif name in _HIGHEST_INT:
            setattr(self, _HIGHEST_INT[name], _max_int(getattr(self, _HIGHEST_INT[name]), value))
        elif name in _HIGHEST_TIME:
            setattr(self, _HIGHEST_TIME[name], _max(getattr(self, _HIGHEST_TIME[name]), value))
        elif name == LEARNING_RATE and math.isfinite(value):
            self.lr = value


_HIGHEST_INT = {
    TARGET_STEPS: "total_steps",
    WORLD_SIZE: "world_size",
    LAST_CHECKPOINT_STEP: "last_checkpoint_step",
}
"""Snapshot fields that hold the highest value of their metric over the series seen."""
_HIGHEST_TIME = {LAST_STEP_TIME: "last_step_unix", LAST_CHECKPOINT_TIME: "last_checkpoint_unix"}
"""The same for timestamps."""


def _rank(labels: dict[str, str]) -> int | None:
    try:
        return int(labels["rank"])
    except (KeyError, ValueError):
        return None


def _bound(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _max(a: float | None, b: float) -> float | None:
    if not math.isfinite(b):
        return a
    return b if a is None else max(a, b)


def _max_int(a: int | None, b: float) -> int | None:
    if not math.isfinite(b):
        return a
    return int(b) if a is None else max(a, int(b))


class RateWindow:
    """The snapshots of the last ``span_s`` seconds, to compute rates over a steady window.

    Args:
        span_s: how far back the baseline of a rate may lie.

    Raises:
        ValueError: ``span_s`` is not positive.
    """

    def __init__(self, span_s: float) -> None:
        if not span_s > 0:
            raise ValueError(f"span_s must be > 0, got {span_s}")
        self.span_s = span_s
        self._snapshots: deque[Snapshot] = deque()

    def add(self, snapshot: Snapshot) -> Snapshot | None:
        """Keep ``snapshot``; return the baseline to compare it with (``None``: no earlier one).

        A step lower than the previous snapshot's (a resume from an older checkpoint), the first
        step after none (training started or resumed), fewer samples (a launcher restarted) or
        another run starts the window again."""
        if self._snapshots:
            last = self._snapshots[-1]
            went_back = snapshot.step is not None and (
                last.step is None or snapshot.step < last.step
            )
            if went_back or snapshot.samples < last.samples or snapshot.run_ids != last.run_ids:
                self._snapshots.clear()
        # Keep one snapshot at or beyond the span, so the baseline covers the whole window.
        while (
            len(self._snapshots) >= 2
            and snapshot.taken_at - self._snapshots[1].taken_at >= self.span_s
        ):
            self._snapshots.popleft()
        baseline = self._snapshots[0] if self._snapshots else None
        self._snapshots.append(snapshot)
        return baseline


@dataclass(kw_only=True, slots=True)
class Straggler:
    """The rank whose mean compute time per step is the largest."""

    node: str
    rank: int
    compute_s: float
    """Its mean ``step_compute`` time per step."""
    vs_median: float
    """That mean divided by the median of all ranks' means (1.0: no straggler)."""


@dataclass(kw_only=True, slots=True)
class ProgressView:
    """What an operator reads: the snapshot's values and the rates against a baseline."""

    run_id: str | None
    step: int | None
    total_steps: int | None
    world_size: int | None
    steps_per_s: float | None
    samples_per_s: float | None
    samples_estimated: bool
    """``samples_per_s`` was scaled up from fewer ranks than the world has."""
    eta_s: float | None
    step_time_p50_s: float | None
    last_step_unix: float | None
    last_checkpoint_step: int | None
    last_checkpoint_unix: float | None
    loss: float | None
    lr: float | None
    slowest: Straggler | None
    nodes: dict[str, NodeStats]
    run_ids: tuple[str, ...] = ()

    @property
    def restarts(self) -> float | None:
        """The job's restarts (:func:`job_counts`)."""
        return job_counts(self.nodes)[0]

    @property
    def heals(self) -> float | None:
        """The job's in-place heals (:func:`job_counts`)."""
        return job_counts(self.nodes)[1]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        out = asdict(self)
        out["restarts"] = self.restarts
        out["heals"] = self.heals
        out["run_ids"] = list(self.run_ids)
        return out


def job_counts(nodes: dict[str, NodeStats]) -> tuple[float | None, float | None]:
    """The job's (restarts, in-place heals): those counted by the node that hosts global rank 0,
    else (no such node seen) the highest of the nodes seen; ``None`` where no node counts.

    Each node's launcher counts the restarts and heals it took part in, so nodes that joined
    at different times differ. Rank 0's node is the one every reader sees: it publishes the
    record ``elastic-trainer status`` shows, and ``top`` over every node finds it too, so the
    tools agree. Two nodes claiming rank 0 (a heal under way): the higher of theirs."""
    hosts = [stats for stats in nodes.values() if 0 in stats.ranks] or list(nodes.values())
    restarts = [s.restarts for s in hosts if s.restarts is not None]
    heals = [s.heals for s in hosts if s.heals is not None]
    return (max(restarts) if restarts else None, max(heals) if heals else None)


def progress_view(current: Snapshot, baseline: Snapshot | None) -> ProgressView:
    """The view of ``current``, with rates over ``current.taken_at - baseline.taken_at``."""
    elapsed = current.taken_at - baseline.taken_at if baseline is not None else 0.0
    steps_per_s = samples_per_s = None
    buckets = current.step_buckets
    compute = current.compute
    if baseline is not None and elapsed > 0:
        if current.step is not None and baseline.step is not None and current.step >= baseline.step:
            steps_per_s = (current.step - baseline.step) / elapsed
        if current.samples >= baseline.samples and (current.samples > 0 or current.live_ranks):
            samples_per_s = (current.samples - baseline.samples) / elapsed
        delta = {le: n - baseline.step_buckets.get(le, 0.0) for le, n in buckets.items()}
        if max(delta.values(), default=0.0) > 0:
            buckets = delta
        moved = {r: (s - baseline.compute[r][0], n - baseline.compute[r][1])
                 for r, (s, n) in compute.items() if r in baseline.compute and n > baseline.compute[r][1]}  # fmt: skip
        if len(moved) >= 2:
            compute = moved
    live = current.live_ranks
    estimated = False
    if samples_per_s is not None and current.world_size and live and len(live) < current.world_size:
        samples_per_s *= current.world_size / len(live)
        estimated = True
    return ProgressView(
        run_id=current.run_ids[0] if len(current.run_ids) == 1 else None,
        run_ids=current.run_ids,
        step=current.step,
        total_steps=current.total_steps,
        world_size=current.world_size,
        steps_per_s=steps_per_s,
        samples_per_s=samples_per_s,
        samples_estimated=estimated,
        eta_s=eta_seconds(current.step, current.total_steps, steps_per_s),
        step_time_p50_s=histogram_quantile(0.5, buckets),
        last_step_unix=current.last_step_unix,
        last_checkpoint_step=current.last_checkpoint_step,
        last_checkpoint_unix=current.last_checkpoint_unix,
        loss=current.loss,
        lr=current.lr,
        slowest=slowest_rank(compute, only=live or None),
        nodes=current.nodes,
    )


def eta_seconds(
    step: int | None, total_steps: int | None, steps_per_s: float | None
) -> float | None:
    """Seconds until ``total_steps`` at ``steps_per_s``: (total - step) / rate; ``None`` when
    any is unknown or the job makes no progress."""
    if step is None or total_steps is None or steps_per_s is None or not steps_per_s > 0:
        return None
    return max(0, total_steps - step) / steps_per_s


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative bucket counts keyed by upper bound:
    linear within the bucket that holds the quantile; the highest finite bound if that is
    the ``+Inf`` bucket; ``None`` without observations."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return None
    total = buckets[math.inf]
    if not total > 0:
        return None
    target = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= target and count > below:
            if bound == math.inf:
                return lower
            return lower + (bound - lower) * (target - below) / (count - below)
        lower, below = bound, count
    return lower


def slowest_rank(
    compute: dict[RankId, tuple[float, float]], *, only: set[RankId] | None = None
) -> Straggler | None:
    """The rank with the largest mean compute time per step, against the median of all ranks'
    means; ``None`` with fewer than two ranks (nothing to compare with)."""
    means = {r: s / n for r, (s, n) in compute.items() if n > 0 and (only is None or r in only)}
    if len(means) < 2:
        return None
    median = statistics.median(means.values())
    (node, rank), worst = max(means.items(), key=lambda item: (item[1], item[0]))
    return Straggler(
        node=node, rank=rank, compute_s=worst, vs_median=worst / median if median > 0 else math.inf
    )


def format_duration(seconds: float | None) -> str:
    """``1h02m``, ``3m05s``, ``12s``, ``0.4s``; ``-`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 0:
        seconds = 0.0
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours >= 48:
        return f"{hours // 24}d{hours % 24:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
