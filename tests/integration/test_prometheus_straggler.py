"""The straggler signal on real DDP: two gloo ranks, one of them slowed down every step.

Whole-step times come out equal (the fast rank waits in the gradient allreduce), which is why
the dashboard compares ``elastic_trainer_step_compute_seconds`` instead: the slow rank's compute
time must stand out while its step time does not.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_trainer.runtime.process_exit import exit_process
from rendezvous.etcd_server import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SLOW_RANK = 1
DELAY_S = 0.04
STEPS = 25


def _worker(rank: int, world: int, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from prometheus_client import CollectorRegistry

        from elastic_trainer.metrics.worker import PrometheusObserver, WorkerLabels

        registry = CollectorRegistry()
        labels = WorkerLabels(run_id="job", node="n", rank=rank, local_rank=rank)
        observer = PrometheusObserver(labels=labels, registry=registry)
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(
                torch.nn.Sequential(
                    torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
                )
            )
        plain = torch.nn.parallel.DistributedDataParallel(models[0])
        ddp = torch.nn.parallel.DistributedDataParallel(models[1])
        observer.wrap_ddp(ddp)
        # The observer leaves DDP's built-in allreduce alone: the same gradients (inputs differ by rank).
        sample = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        for model in (plain, ddp):
            model(sample).square().mean().backward()
        for a, b in zip(plain.parameters(), ddp.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-7), "hooked gradients differ"
        ddp.zero_grad()
        observer.on_start(world_size=world, restart_count=0)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        x = torch.randn(32, 64)
        for step in range(1, STEPS + 1):
            started = time.monotonic()
            if rank == SLOW_RANK:
                time.sleep(DELAY_S)  # a slow input pipeline or a slow GPU, before the forward
            loss = ddp(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            observer.on_step(step=step, duration_s=time.monotonic() - started, data_wait_s=0.0,
                             samples=32, tokens=0, loss=loss.item())  # fmt: skip
        observer.flush()  # the last second's steps (the observer writes once a second)
        names = {"run_id": "job", "node": "n", "rank": str(rank), "local_rank": str(rank)}

        def mean(metric: str) -> float:
            total = registry.get_sample_value(f"{metric}_sum", names)
            count = registry.get_sample_value(f"{metric}_count", names)
            assert total is not None and count
            return total / count

        results.put(
            (rank, mean("elastic_trainer_step_duration_seconds"),
             mean("elastic_trainer_step_compute_seconds"))
        )  # fmt: skip
    finally:
        dist.destroy_process_group()
    exit_process(0)  # torch 2.13's gloo can abort in interpreter teardown (runtime/process_exit.py)


def test_compute_time_singles_out_the_slow_rank_while_step_times_agree() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(2, free_port(), results), nprocs=2, start_method="spawn")
    by_rank = dict(
        (r, (step, compute)) for r, step, compute in (results.get(timeout=30) for _ in range(2))
    )
    (step_fast, compute_fast), (step_slow, compute_slow) = by_rank[0], by_rank[SLOW_RANK]
    # The fast rank spent the delay waiting in the allreduce: both step times include it.
    assert step_fast > DELAY_S and step_slow > DELAY_S
    assert abs(step_fast - step_slow) < 0.5 * DELAY_S
    # Compute time excludes the wait: the slow rank is ahead by about the injected delay.
    assert compute_slow - compute_fast > 0.5 * DELAY_S
    assert compute_slow / compute_fast > 1.5
