"""Fault tolerance at its defaults against a bare DDP loop, side by side: what a healthy step costs.

    python -m benchmarks.overhead_e2e --blocks 6                         # example CNN, 2 gloo ranks
    python -m benchmarks.overhead_e2e --width 48 --blocks 6 --steps 100  # a ~25 ms CPU step
    python -m benchmarks.overhead_e2e --device cuda --model gpt --blocks 4 --steps 100

``bare``: the DDP guides' loop (``DistributedSampler``, ``DataLoader``, ``DDP``, SGD). ``defaults``:
the same job through ``Trainer`` with everything at its default, as under ``elastic-trainer run``:
the elastic sampler, per-step random streams, the per-step control, metrics through the real
worker observer and its allreduce timing (``PROMETHEUS_MULTIPROC_DIR`` set, as the launcher does),
the just-in-time save armed, asynchronous checkpoints every 100 steps (the default interval), a
progress line every 10 steps (no healer in-process: its tracked control waits are left out, and
since issue 30 no hook touches DDP's buckets either way; warm start changes restarts only).
The claim is ``benchmarks/launcher_e2e.py``, through the real launchers; this explains it. Both run in the same two warm
processes in alternating blocks, so that noise hits both alike. Reported: the median of the
per-block throughput ratios, the CPU time per sample (both ranks, every thread: the cost of each
loop whatever else runs on the machine), and percentiles of the step time (p50, p99, max) over
every timed step, which show stalls (a checkpoint, a metrics flush) that medians hide.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.runtime_throughput import report_blocks
from benchmarks.workloads import (
    add_workload_arguments,
    init_worker,
    resolve_workload_arguments,
    workload_of,
)
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.runtime.distributed import read_env
from elastic_trainer.train.config import TrainerConfig
from elastic_trainer.train.trainer import Trainer, TrainingJob

VARIANTS = ("bare", "defaults")


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _bare(args: argparse.Namespace, rank: int, world: int) -> list[tuple[float, float]]:
    torch.manual_seed(args.seed)
    job = workload_of(args)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    model = DDP(job.model().to(device), device_ids=[rank] if device.type == "cuda" else None)
    dataset = job.dataset()
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, seed=args.seed, drop_last=True
    )
    loader = DataLoader(
        dataset,
        batch_size=args.global_batch_size // world,
        sampler=sampler,
        drop_last=True,
        pin_memory=device.type == "cuda",
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    times: list[tuple[float, float]] = []
    total, epoch = args.warmup + args.steps, 0
    while len(times) < total:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                loss = job.loss(model(x), y)
            loss.backward()
            optimizer.step()
            if device.type == "cuda" and len(times) + 1 in (args.warmup, total):
                torch.cuda.synchronize()  # the window starts and ends when the GPU is done
            times.append(_now())
            if len(times) >= total:
                break
        epoch += 1
    return times


def _defaults(args: argparse.Namespace, checkpoint_dir: str) -> list[tuple[float, float]]:
    spec = workload_of(args)
    job = TrainingJob(
        model=spec.model,
        dataset=spec.dataset,
        loss=spec.loss,
        tokens_per_sample=spec.tokens_per_sample,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4),
    )
    config = TrainerConfig(
        global_batch_size=args.global_batch_size,
        seed=args.seed,
        epochs=10_000,
        max_steps=args.warmup + args.steps,
        checkpoint=CheckpointConfig(directory=checkpoint_dir),
        mixed_precision="bf16" if args.bf16 else "no",
    )
    times: list[tuple[float, float]] = []
    total = args.warmup + args.steps

    def clock(trainer: Trainer, step: int) -> None:
        if args.device == "cuda" and step in (args.warmup, total):
            torch.cuda.synchronize()
        times.append(_now())

    env = read_env(cuda_devices=0) if args.device == "cpu" else None
    # In-process there is no healer: the control's waits are plain (under `elastic-trainer run`
    # they are tracked; DDP's buckets are not, either way: runtime/comms.py).
    Trainer(config, job, env=env, callbacks=[clock]).fit()
    return times


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    init_worker(rank, world, port, args)
    os.environ.update(
        ELASTIC_TRAINER_METRICS="1",
        TORCHELASTIC_RUN_ID="overhead-e2e",
        RANK=str(rank),
        LOCAL_RANK=str(rank % max(1, torch.cuda.device_count() or 1)),
    )
    lines = []
    try:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            for block in range(args.blocks):
                order = VARIANTS if block % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    times = (
                        _bare(args, rank, world)
                        if variant == "bare"
                        else _defaults(args, f"{tmp}/ckpt-{block}")
                    )
                    lines.append(_line(args, block, variant, times))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text("\n".join(lines))


def _line(
    args: argparse.Namespace, block: int, variant: str, times: list[tuple[float, float]]
) -> str:
    window = times[args.warmup - 1 :]
    samples = args.steps * args.global_batch_size
    wall = window[-1][0] - window[0][0]
    steps = ",".join(f"{(b[0] - a[0]) * 1e3:.3f}" for a, b in zip(window, window[1:], strict=False))
    cpu = torch.tensor([window[-1][1] - window[0][1]], dtype=torch.float64)
    if args.device == "cuda":
        cpu = cpu.cuda()
    dist.all_reduce(cpu)
    return f"{block} {variant} {samples / wall} {float(cpu.cpu()[0]) / samples * 1e6} {steps}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--blocks", type=int, default=6, help="rounds of (bare, defaults), order alternating"
    )
    parser.add_argument(
        "--steps", type=int, default=200, help="timed steps per block (200: two checkpoints)"
    )
    parser.add_argument(
        "--warmup", type=int, default=20, help="untimed steps at the start of each block"
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--tmp", default=None, help="directory for checkpoints and metrics (default: system temp)"
    )
    args = parser.parse_args()
    resolve_workload_arguments(parser, args)
    with tempfile.TemporaryDirectory(dir=args.tmp) as metrics:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = (
            metrics  # before the workers import prometheus_client
        )
        report_blocks(args, _worker, VARIANTS, baseline="bare")


if __name__ == "__main__":
    main()
