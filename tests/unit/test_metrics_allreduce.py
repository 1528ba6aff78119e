"""The allreduce metrics on a real (single-process gloo) DDP model: the default reads DDP's own
sampled C++ timing and registers no comm hook (issue 30)."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from elastic_trainer.metrics.worker import PrometheusObserver, WorkerLabels

pytestmark = pytest.mark.timeout(60)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 8))


def test_the_default_times_allreduces_from_ddp_s_sampled_statistics_without_a_hook(
    gloo_world: None,
) -> None:
    """Issue 30: the default puts nothing on DDP's per-bucket path; the allreduce metrics come from
    DDP's own C++ timing of sampled backwards (its first ten, then one in ten)."""
    from elastic_trainer.runtime import torch_compat

    registry = CollectorRegistry()
    labels = WorkerLabels(run_id="j", node="n", rank=0, local_rank=0)
    observer = PrometheusObserver(labels=labels, registry=registry, flush_interval_s=0.0)
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.05)
    observer.wrap_ddp(ddp)
    assert torch_compat.comm_hooks(ddp) == [], "no Python comm hook at the default"
    observer.on_start(world_size=1, restart_count=0)
    x = torch.randn(16, 64)
    rank = {"run_id": "j", "node": "n", "rank": "0", "local_rank": "0"}
    steps = 3
    for n in range(1, steps + 1):
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        observer.on_step(step=n, duration_s=0.1, data_wait_s=0.0, samples=16, tokens=0, loss=None)
    # DDP computes a backward's statistics at the next forward: the last one is not in yet.
    samples = registry.get_sample_value("elastic_trainer_allreduce_duration_seconds_count", rank)
    assert samples == steps - 1, (
        "one sample per flush here (each of DDP's first ten backwards is timed)"
    )
    param_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters())
    sizes = [int(s) for s in torch_compat.ddp_logging_data(ddp)["rebuilt_bucket_sizes"].split(",")]
    assert (
        len(sizes) >= 2 and sum(sizes) == param_bytes
    )  # per parameter: a first bucket, then 0.05 MB caps
    assert (
        registry.get_sample_value("elastic_trainer_allreduce_bucket_bytes_sum", rank)
        == (steps - 1) * param_bytes
    )
    # Every step's bytes count, at the newest sample's sizes (none before the first sample).
    assert (
        registry.get_sample_value("elastic_trainer_allreduce_bytes_total", rank)
        == (steps - 1) * param_bytes
    )
    assert registry.get_sample_value("elastic_trainer_step_compute_seconds_count", rank) == steps
    compute = registry.get_sample_value("elastic_trainer_step_compute_seconds_sum", rank)
    assert compute is not None and 0 < compute <= steps * 0.1
