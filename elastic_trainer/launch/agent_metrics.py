"""Metrics of the torchrun agent: restarts, in-place heals, rendezvous rounds, membership, worker-group state.

Read from torch's two public seams in the launcher process: the ``torchelastic`` metric group
(:class:`TorchElasticMetricHandler`, called every monitor tick, so it stays cheap) and the agent's
JSON events on the ``torchelastic-events-*`` loggers (:class:`AgentEventHandler`). Kept in plain
Python behind a custom collector, never in prometheus-client's value classes (which would write
into the workers' multiprocess directory). Metric names and meanings: ``docs/design/metrics.md``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from torch.distributed.elastic import metrics as torch_metrics
from torch.distributed.elastic.metrics.api import MetricData, MetricHandler

from elastic_trainer.runtime import torch_compat

log = logging.getLogger(__name__)

PREFIX = "elastic_trainer_"
TORCHELASTIC_METRIC_GROUP = "torchelastic"
# Event destinations (``--event-log-handler``) torch registers out of the box.
EVENT_DESTINATIONS = ("null", "console")
RENDEZVOUS_SECONDS_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# torch's WorkerState names, lower-cased as in its ``workers.<role>.<state>`` metrics.
WORKER_STATES = ("unknown", "init", "healthy", "unhealthy", "stopped", "succeeded", "failed")

_REMAINING_SUFFIX = ".remaining_restarts"
_RENDEZVOUS_EVENT = "torchelastic.worker.status.RENDEZVOUS"
_START_EVENT = "torchelastic.worker.status.START"


class _Histogram:
    """Cumulative buckets, sum and count of one label set."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last: +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(acc)))
        return out


class AgentMetrics:
    """The agent's metrics for one node, as a prometheus-client collector.

    Args:
        run_id: the job's rendezvous id.
        node: this node's name (:mod:`elastic_trainer.metrics.node_name`), the workers' ``node`` label.
        registry: registered there when given (tests inject their own).
    """

    def __init__(
        self, *, run_id: str, node: str, registry: CollectorRegistry | None = None
    ) -> None:
        if not run_id:
            raise ValueError("run_id must not be empty")
        if not node:
            raise ValueError("node must not be empty")
        self.run_id, self.node = run_id, node
        self._labels = [run_id, node]
        self._lock = threading.Lock()  # written by the agent thread, read by scrapes
        self._restarts = 0
        self._heals = 0
        self._remaining_restarts: int | None = None
        self._state: str | None = None
        self._rendezvous = _Histogram(RENDEZVOUS_SECONDS_BUCKETS)
        self._nodes: int | None = None
        self._membership_changes = 0
        self._round_pending = False
        if registry is not None:
            registry.register(self)

    def restarted(self) -> None:
        """The agent restarted its worker group (after a failure or a membership change)."""
        with self._lock:
            self._restarts += 1

    def healed(self, nodes: int | None = None) -> None:
        """The job's workers healed in place (a new epoch, no restart; ``elastic_trainer.launch.in_place``)
        into ``nodes`` nodes: a node lost or joined changes the membership as a new round would."""
        with self._lock:
            self._heals += 1
            if nodes is None:
                return
            if self._nodes is not None and nodes != self._nodes:
                self._membership_changes += 1
            self._nodes = nodes

    def set_remaining_restarts(self, remaining: int) -> None:
        with self._lock:
            self._remaining_restarts = remaining

    def set_state(self, state: str) -> None:
        """The worker group's state as the agent's monitor loop last saw it."""
        state = state.lower()
        if state in WORKER_STATES:
            with self._lock:
                self._state = state

    def rendezvous_finished(self, duration_s: float) -> None:
        """One rendezvous round of this agent took ``duration_s``."""
        with self._lock:
            self._rendezvous.observe(max(0.0, duration_s))
            self._round_pending = True

    def workers_started(self, nodes: int) -> None:
        """A worker started in a group of ``nodes`` nodes (once per worker; rounds deduplicated)."""
        with self._lock:
            if not self._round_pending and self._nodes is not None:
                return
            self._round_pending = False
            if self._nodes is not None and nodes != self._nodes:
                self._membership_changes += 1
            self._nodes = nodes

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            return self._families()

    def _counter(self, name: str, value: float, doc: str) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["run_id", "node"])
        family.add_metric(self._labels, value)
        return family

    def _families(self) -> list[Metric]:
        labels = ["run_id", "node"]
        restarts = self._counter("restarts", self._restarts,
                                 "Worker-group restarts on this node, as its agent counts them: after a worker "
                                 "failure or a membership change.")  # fmt: skip
        heals = self._counter("heals", self._heals,
                              "In-place heals of the job this node's agent saw: the workers formed a new group "
                              "without a restart, after a lost worker or node, or a joining one (--heal in_place).")  # fmt: skip
        remaining = GaugeMetricFamily(
            PREFIX + "agent_remaining_restarts",
            "Failure restarts the agent has left before it gives up (--max-restarts).",
            labels=labels,
        )
        if self._remaining_restarts is not None:
            remaining.add_metric(self._labels, self._remaining_restarts)
        state = GaugeMetricFamily(
            PREFIX + "worker_group_state",
            "1 for the worker group's current state on this node, 0 for the others.",
            labels=[*labels, "state"],
        )
        if self._state is not None:
            for name in WORKER_STATES:
                state.add_metric([*self._labels, name], 1.0 if name == self._state else 0.0)
        rendezvous = HistogramMetricFamily(
            PREFIX + "rendezvous_duration_seconds",
            "Duration of one rendezvous round of this node's agent (_count: rounds).",
            labels=labels,
        )
        rendezvous.add_metric(
            self._labels, self._rendezvous.buckets(), sum_value=self._rendezvous.total
        )
        nodes = GaugeMetricFamily(
            PREFIX + "nodes", "Nodes in the current rendezvous round.", labels=labels
        )
        if self._nodes is not None:
            nodes.add_metric(self._labels, self._nodes)
        changes = CounterMetricFamily(
            PREFIX + "membership_changes",
            "Rendezvous rounds whose node count differed from this agent's previous round.",
            labels=labels,
        )
        changes.add_metric(self._labels, self._membership_changes)
        return [restarts, heals, remaining, state, rendezvous, nodes, changes]


class TorchElasticMetricHandler(MetricHandler):
    """Feeds torch elastic's ``put_metric`` values into :class:`AgentMetrics`.

    Install with ``torch.distributed.elastic.metrics.configure(handler, "torchelastic")``.
    Unknown names are ignored: the agent emits several per monitor tick.
    """

    def __init__(self, agent_metrics: AgentMetrics) -> None:
        self._agent = agent_metrics

    def emit(self, metric_data: MetricData) -> None:
        name: str = metric_data.name
        if name.endswith(torch_compat.AGENT_RESTART_METRIC_SUFFIX):
            self._agent.restarted()
        elif name.endswith(_REMAINING_SUFFIX):
            self._agent.set_remaining_restarts(int(metric_data.value))
        elif name.startswith("workers.") and metric_data.value == 1:
            self._agent.set_state(name.rsplit(".", 1)[-1])


class AgentEventHandler(logging.Handler):
    """A logging handler that reads the agent's torch elastic events into :class:`AgentMetrics`."""

    def __init__(self, agent_metrics: AgentMetrics) -> None:
        super().__init__(level=logging.DEBUG)
        self._agent = agent_metrics
        self._warned = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = json.loads(record.getMessage())
            name = event.get("name", "")
            if name == _RENDEZVOUS_EVENT:
                duration_ms = event["metadata"].get("duration_ms")
                if duration_ms is not None:
                    self._agent.rendezvous_finished(float(duration_ms) / 1000.0)
            elif name == _START_EVENT:
                self._agent.workers_started(torch_compat.start_event_nodes(event["metadata"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # A torch upgrade changed the event format: say so once, keep the agent running.
            if not self._warned:
                self._warned = True
                log.warning("cannot read torch elastic event %.200r: %s", record.msg, exc)


def install_agent_hooks(
    agent_metrics: AgentMetrics, *, destinations: Sequence[str] = EVENT_DESTINATIONS
) -> Callable[[], None]:
    """Route the agent's torch elastic metrics and events into ``agent_metrics``.

    Returns:
        A function that restores the previous metric handler and removes the event handler.
    """
    previous = torch_metrics.getStream(TORCHELASTIC_METRIC_GROUP).handler
    torch_metrics.configure(TorchElasticMetricHandler(agent_metrics), TORCHELASTIC_METRIC_GROUP)
    handler = AgentEventHandler(agent_metrics)
    loggers = [logging.getLogger(f"torchelastic-events-{d}") for d in destinations]
    for logger in loggers:
        logger.addHandler(handler)

    def uninstall() -> None:
        torch_metrics.configure(previous, TORCHELASTIC_METRIC_GROUP)
        for logger in loggers:
            logger.removeHandler(handler)

    return uninstall
