"""Allreduce timing through the flight recorder vs DDP's own sampled statistics, side by side.

Issue 5's overhead goal (metrics on/off >= 0.99) failed on a GPU because of a Python hook's cost
per DDP bucket (``benchmarks/RESULTS.md``, session 5); issue 30 removed that hook. Both remaining
modes time buckets without one: torch's flight recorder writes every collective in C++, NCCL adds
its GPU duration, and :class:`elastic_trainer.metrics.collective_trace.CollectiveTrace` reads them
once in a while (``trace``); DDP's reducer times a sample of backwards in C++ and
:class:`~elastic_trainer.metrics.ddp_stats.SampledDdpTimer` reads them (``sampled``, the default).
This benchmark measures both on the same workload:

- phase "sampled" (torch's defaults: the recorder on with 2000 entries, NCCL timing off): arms
  ``off`` (plain DDP) and ``sampled`` (DDP's statistics, read at each flush);
- phase "trace" (``TORCH_FR_BUFFER_SIZE=--ring``, ``TORCH_NCCL_ENABLE_TIMING=1``): arms ``off``
  and ``trace`` (no hook; a :class:`~elastic_trainer.metrics.bucket_trace.TracedBucketTimer`,
  which reads the recorder once about half its ring is new).

Every ``--read-interval`` s (the observer's flush) the sampled or trace arm's timer is read into a
Prometheus histogram, inside that arm's step time. Within a phase the arms alternate step by step
and each arm's DDP has a process group of its own, so the reader sees its arm's buckets only. Each
arm's cost ``d`` is taken per cycle against the off step next to it; ratio = off / (off + d) with
the mean d (reads and drains included). NCCL's timing events fall on both arms of the trace
phase: the "timing" line compares the two phases' off arms (different processes: comparable
within one run on one machine only). On CPU (gloo) the recorder times nothing (gloo never
completes its entries), so the trace arm there measures reading, not a working design.

Usage::

    python -m benchmarks.flight_recorder_cost --cycles 200                    # CPU smoke run
    python -m benchmarks.flight_recorder_cost --device cuda --model gpt --cycles 300 --repeat 2
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import time
from typing import Any

from benchmarks.workloads import add_workload_arguments, resolve_workload_arguments
from rendezvous.etcd_server import free_port

PHASES = {"sampled": ("off", "sampled"), "trace": ("off", "trace")}
SETTLE = 10  # cycles left out at the start (DDP rebuilds its buckets after the first)


def worker(
    rank: int, world: int, port: int, args: argparse.Namespace, phase: str, results: Any
) -> None:
    """One rank of a phase (torch.multiprocessing spawn target); rank 0 reports."""
    from elastic_trainer.metrics.collective_trace import trace_environment

    if phase == "trace":
        trace_environment(os.environ, entries=args.ring)  # before the first process group
    import prometheus_client
    import torch
    import torch.distributed as dist

    from benchmarks.workloads import autocast_of, init_worker, rank_batches, train_step, workload_of
    from elastic_trainer.metrics.bucket_trace import TracedBucketTimer
    from elastic_trainer.metrics.ddp_stats import DEFAULT_SAMPLE_EVERY, SampledDdpTimer

    init_worker(rank, world, port, args)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    job = workload_of(args)
    batches = rank_batches(job, args, rank, world, device)
    autocast = autocast_of(args)
    arms = PHASES[phase]
    histogram = prometheus_client.Histogram(
        "allreduce_seconds", "", registry=prometheus_client.CollectorRegistry()
    )
    setups: dict[str, tuple[Any, Any]] = {}
    timers: dict[str, SampledDdpTimer | TracedBucketTimer] = {}
    for arm in arms:
        group = dist.new_group(list(range(world)))
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(job.model().to(device), device_ids=[rank] if cuda else None,
                                                        process_group=group)  # fmt: skip
        if arm == "sampled":  # as the observer sets it up
            timers[arm] = SampledDdpTimer(ddp, sample_every=None if cuda else DEFAULT_SAMPLE_EVERY)
        elif arm == "trace":
            timers[arm] = TracedBucketTimer(ddp)
        setups[arm] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))

    stats = {"drains": 0, "drain_s": 0.0, "timed": 0}

    def periodic(arm: str) -> None:
        """The observer's work once per flush: read the arm's timer into a histogram."""
        started = time.perf_counter()
        timer = timers[arm]
        if isinstance(timer, SampledDdpTimer):
            sample = timer.poll()
            if sample is not None:
                histogram.observe(sample.comm_s)
                stats["timed"] += len(sample.bucket_bytes)
        else:
            for timing in timer.drain():
                histogram.observe(timing.duration_s)
                stats["timed"] += 1
        stats["drains"] += 1
        stats["drain_s"] += time.perf_counter() - started

    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    next_read = {arm: time.perf_counter() + args.read_interval for arm in arms if arm != "off"}
    for cycle in range(SETTLE + args.cycles):
        x, y = batches[cycle % len(batches)]
        for arm in arms if cycle % 2 == 0 else arms[::-1]:
            ddp, opt = setups[arm]
            started = time.perf_counter()
            train_step(job, ddp, opt, x, y, autocast)
            if arm != "off" and started >= next_read[arm]:
                periodic(arm)
                next_read[arm] = started + args.read_interval
            if cycle >= SETTLE:
                wall[arm].append(time.perf_counter() - started)
    traced = timers.get("trace")
    if isinstance(traced, TracedBucketTimer):
        stats.update(reads=traced.trace.reads, dropped=traced.dropped, untimed=traced.trace.untimed)
    if rank == 0:
        results.put((wall, stats))
    dist.destroy_process_group()


def run_phase(
    phase: str, args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").Queue()
    context = mp.start_processes(worker, args=(args.nproc, free_port(), args, phase, results), nprocs=args.nproc,
                                 start_method="spawn", join=False)  # fmt: skip
    while True:
        try:
            report = results.get(timeout=1.0)
            break
        except queue.Empty:
            context.join(timeout=0)  # raises if a rank failed
    while not context.join():
        pass
    return report  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_arguments(parser, width=32)
    parser.add_argument(
        "--cycles", type=int, default=400, help="measured cycles per phase (one step per arm)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of both phases, their order alternating"
    )
    parser.add_argument(
        "--read-interval", type=float, default=1.0, help="seconds between reads/drains"
    )
    parser.add_argument(
        "--ring", type=int, default=2000, help="flight recorder entries (trace phase)"
    )
    args = parser.parse_args()
    resolve_workload_arguments(parser, args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"model {args.model}, {args.nproc} {'NCCL' if args.device == 'cuda' else 'gloo'} rank(s), "
          f"{args.cycles} cycles per phase, reads every {args.read_interval} s, ring {args.ring}")  # fmt: skip
    print(
        "| run | phase | off ms/step (median) | arm ms/step (median) | mean d, us | ratio off/(off+d) | notes |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for run in range(args.repeat):
        offs: dict[str, float] = {}
        for phase in PHASES if run % 2 == 0 else list(PHASES)[::-1]:
            wall, stats = run_phase(phase, args)
            arm = PHASES[phase][1]
            off, mine = wall["off"], wall[arm]
            d = statistics.fmean(a - b for a, b in zip(mine, off, strict=True))
            offs[phase] = statistics.fmean(off)
            notes = (f"{stats['drains']} drains, {stats['drain_s'] / max(stats['drains'], 1) * 1e3:.2f} ms each, "
                     f"{stats['timed']} buckets timed")  # fmt: skip
            if arm == "trace":
                notes += f"; {stats['reads']} recorder reads, {stats['untimed']} untimed, {stats['dropped']} dropped"
            print(f"| {run} | {phase} | {statistics.median(off) * 1e3:.2f} | {statistics.median(mine) * 1e3:.2f} "
                  f"| {d * 1e6:.0f} | {statistics.fmean(off) / (statistics.fmean(off) + d):.4f} | {notes} |",
                  flush=True)  # fmt: skip
        print(f"| {run} | timing | mean off step, trace phase / sampled phase: {offs['trace'] / offs['sampled']:.4f} "
              "| | | | different processes |")  # fmt: skip


if __name__ == "__main__":
    main()
