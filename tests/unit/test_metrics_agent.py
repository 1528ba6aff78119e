"""Agent metrics, fed through torch elastic's real metrics and events APIs."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from torch.distributed.elastic import events as torch_events
from torch.distributed.elastic import metrics as torch_metrics
from torch.distributed.elastic.events import Event, EventSource

from elastic_trainer.launch.agent_metrics import AgentMetrics, install_agent_hooks

pytestmark = pytest.mark.timeout(60)

NODE = {"run_id": "job", "node": "host-a"}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def agent(registry: CollectorRegistry) -> Iterator[AgentMetrics]:
    agent = AgentMetrics(run_id="job", node="host-a", registry=registry)
    uninstall = install_agent_hooks(agent)
    try:
        yield agent
    finally:
        uninstall()


def value(registry: CollectorRegistry, name: str, **extra: str) -> float | None:
    return registry.get_sample_value(name, {**NODE, **extra})


def agent_event(state: str, *, group_world_size: int, duration_ms: float | None = None) -> Event:
    """An event shaped exactly like torch 2.13's SimpleElasticAgent._construct_event."""
    md = {"group_world_size": group_world_size, "entry_point": "python"}
    if state == "START":
        md.update(
            local_rank=[0], role_rank=[0], role_world_size=[2], exit_code=[None], worker_pid=[None]
        )
    metadata = {
        "run_id": "job",
        "global_rank": 0 if state == "START" else None,
        "group_rank": 0,
        "worker_id": "1234" if state == "START" else None,
        "role": "default",
        "hostname": "host-a",
        "state": state,
        "total_run_time": 0,
        "rdzv_backend": "etcd-v3",
        "raw_error": None,
        "metadata": json.dumps(md),
        "agent_restarts": 0,
        "duration_ms": duration_ms,
    }
    return Event(f"torchelastic.worker.status.{state}", source=EventSource.AGENT, metadata=metadata)


def test_restarts_remaining_and_state_from_put_metric(
    agent: AgentMetrics, registry: CollectorRegistry
) -> None:
    assert value(registry, "elastic_trainer_restarts_total") == 0
    # What @prof on SimpleElasticAgent._restart_workers and the monitor loop emit.
    torch_metrics.put_metric("SimpleElasticAgent._restart_workers.success", 1)
    torch_metrics.put_metric("SimpleElasticAgent._restart_workers.duration.ms", 1200)
    torch_metrics.put_metric("workers.default.remaining_restarts", 2)
    torch_metrics.put_metric("workers.default.healthy", 1)
    assert value(registry, "elastic_trainer_restarts_total") == 1
    assert value(registry, "elastic_trainer_agent_remaining_restarts") == 2
    assert value(registry, "elastic_trainer_worker_group_state", state="healthy") == 1
    assert value(registry, "elastic_trainer_worker_group_state", state="failed") == 0
    torch_metrics.put_metric("workers.default.unhealthy", 1)
    assert value(registry, "elastic_trainer_worker_group_state", state="healthy") == 0
    assert value(registry, "elastic_trainer_worker_group_state", state="unhealthy") == 1


def test_one_restart_count(agent: AgentMetrics, registry: CollectorRegistry) -> None:
    """A failure restart and a membership-change restart count alike, in one counter; no other
    metric counts restarts (the workers' own count used to disagree with the agent's)."""
    torch_metrics.put_metric("workers.default.remaining_restarts", 3)
    torch_metrics.put_metric("SimpleElasticAgent._restart_workers.duration.ms", 900)  # a failure
    torch_metrics.put_metric("workers.default.remaining_restarts", 2)
    torch_metrics.put_metric(
        "SimpleElasticAgent._restart_workers.duration.ms", 700
    )  # a node joined
    assert value(registry, "elastic_trainer_restarts_total") == 2
    counts = [m.name for m in registry.collect() if "restarts" in m.name and m.type == "counter"]
    assert counts == ["elastic_trainer_restarts"]


def test_rendezvous_rounds_and_membership_from_events(
    agent: AgentMetrics, registry: CollectorRegistry
) -> None:
    # Round 1: 2 nodes, 2 workers started here. Round 2: same size. Round 3: shrunk to 1 node.
    for duration_ms, nodes in ((1500.0, 2), (800.0, 2), (31000.0, 1)):
        torch_events.record(
            agent_event("RENDEZVOUS", group_world_size=nodes, duration_ms=duration_ms)
        )
        for _ in range(2):
            torch_events.record(agent_event("START", group_world_size=nodes))
    assert value(registry, "elastic_trainer_rendezvous_duration_seconds_count") == 3
    assert value(registry, "elastic_trainer_rendezvous_duration_seconds_sum") == pytest.approx(33.3)
    assert value(registry, "elastic_trainer_rendezvous_duration_seconds_bucket", le="1.0") == 1
    assert value(registry, "elastic_trainer_rendezvous_duration_seconds_bucket", le="+Inf") == 3
    assert value(registry, "elastic_trainer_nodes") == 1
    assert value(registry, "elastic_trainer_membership_changes_total") == 1


def test_events_on_the_console_destination_are_seen_too(
    agent: AgentMetrics, registry: CollectorRegistry
) -> None:
    torch_events.record(agent_event("RENDEZVOUS", group_world_size=1, duration_ms=10.0), "console")
    assert value(registry, "elastic_trainer_rendezvous_duration_seconds_count") == 1


def test_unreadable_event_is_reported_once_and_ignored(
    agent: AgentMetrics, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    bad = Event("torchelastic.worker.status.START", source=EventSource.AGENT, metadata={})
    torch_events.record(bad)
    torch_events.record(bad)
    assert [r.levelname for r in caplog.records if "cannot read" in r.message] == ["WARNING"]
    assert value(registry, "elastic_trainer_nodes") is None


def test_uninstall_restores_previous_handler(registry: CollectorRegistry) -> None:
    before = torch_metrics.getStream("torchelastic").handler
    agent = AgentMetrics(run_id="job", node="host-a", registry=registry)
    uninstall = install_agent_hooks(agent)
    assert torch_metrics.getStream("torchelastic").handler is not before
    uninstall()
    assert torch_metrics.getStream("torchelastic").handler is before
    torch_metrics.put_metric("SimpleElasticAgent._restart_workers.duration.ms", 5)
    torch_events.record(agent_event("RENDEZVOUS", group_world_size=1, duration_ms=1.0))
    assert value(registry, "elastic_trainer_restarts_total") == 0
    assert value(registry, "elastic_trainer_rendezvous_duration_seconds_count") == 0


def test_labels_must_be_given() -> None:
    with pytest.raises(ValueError, match="run_id"):
        AgentMetrics(run_id="", node="n")
    with pytest.raises(ValueError, match="node"):
        AgentMetrics(run_id="r", node="")


def test_heals_are_counted_apart_from_restarts(
    agent: AgentMetrics, registry: CollectorRegistry
) -> None:
    assert value(registry, "elastic_trainer_heals_total") == 0
    agent.healed()
    agent.healed()
    assert value(registry, "elastic_trainer_heals_total") == 2
    assert value(registry, "elastic_trainer_restarts_total") == 0
