"""Steady-state throughput of the elastic-trainer runtime vs a bare DDP loop, side by side.

Same model (the example's SmallCNN by default), same synthetic data, same global batch, same
optimizer, 2 processes on gloo; ``--device cuda`` runs one NCCL process per GPU and ``--model gpt``
a GPT-2-small-shaped decoder in bf16 autocast (``workloads.py``), the real-model measurement.
The bare loop is the textbook one: ``DistributedSampler`` + ``DataLoader`` +
``DDP`` + SGD. The runtime adds its elastic sampler, world-size-invariant loss scaling, one small
allreduce per step (global loss + stop flag), sample accounting and, in the ``runtime+ckpt``
variant, the default checkpoint every 100 steps (synchronous, rank 0).

    python -m benchmarks.runtime_throughput --blocks 6
    python -m benchmarks.runtime_throughput --device cuda --model gpt --blocks 4 --steps 100

Both processes run the variants in alternating blocks (rotating order) so that noise from other
work on the machine hits all variants alike; reported: median throughput over the blocks and
the median of the per-block ratios to the bare loop. On a shared machine wall-clock throughput
is noisy; the CPU time per sample (both ranks, all threads) is the contention-free cost of each
loop and is reported beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.workloads import (
    add_workload_arguments,
    init_worker,
    resolve_workload_arguments,
    workload_of,
)
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.runtime.distributed import read_env
from elastic_trainer.runtime.observer import NullObserver
from elastic_trainer.train.config import TrainerConfig
from elastic_trainer.train.trainer import Trainer, TrainingJob
from rendezvous.etcd_server import free_port


def _now() -> tuple[float, float]:
    """Wall clock and this process's CPU time (all threads): CPU time is what the loop costs,
    whatever else the machine is running."""
    return time.perf_counter(), time.process_time()


class _StepClock(NullObserver):
    """Records wall and CPU time at every step end."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []

    def on_step(self, **kwargs: object) -> None:  # type: ignore[override]
        self.times.append(_now())


def _bare(args: argparse.Namespace, rank: int, world: int) -> list[tuple[float, float]]:
    torch.manual_seed(args.seed)
    job = workload_of(args)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    model = DDP(job.model().to(device), device_ids=[rank] if device.type == "cuda" else None)
    dataset = job.dataset()
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, seed=args.seed, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=args.global_batch_size // world, sampler=sampler, drop_last=True,
                        pin_memory=device.type == "cuda")  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    loss_fn = job.loss
    times: list[tuple[float, float]] = []
    total = args.warmup + args.steps
    epoch = 0
    while len(times) < total:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            if device.type == "cuda" and len(times) + 1 in (args.warmup, total):
                torch.cuda.synchronize()  # the window starts and ends when the GPU is done, not the host
            times.append(_now())
            if len(times) >= total:
                break
        epoch += 1
    return times


def _runtime(args: argparse.Namespace, checkpoint_dir: str | None) -> list[tuple[float, float]]:
    clock = _StepClock()
    spec = workload_of(args)
    job = TrainingJob(
        model=spec.model,
        dataset=spec.dataset,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4),
        loss=spec.loss,
        tokens_per_sample=spec.tokens_per_sample,
    )
    config = TrainerConfig(global_batch_size=args.global_batch_size, seed=args.seed, epochs=10_000,
                           max_steps=args.warmup + args.steps, checkpoint=CheckpointConfig(directory=checkpoint_dir),
                           log_every=10_000,
                           mixed_precision="bf16" if args.bf16 else "no")  # fmt: skip
    env = (
        read_env(cuda_devices=0) if args.device == "cpu" else None
    )  # CPU even where a GPU is visible
    Trainer(config, job, observer=clock, env=env).fit()
    return clock.times


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """Both ranks run every variant in alternating blocks inside the same warm processes, so that
    noise from a shared machine hits all variants alike; rank 0 writes one line per block."""
    init_worker(rank, world, port, args)
    lines = []
    try:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            for block in range(args.blocks):
                shift = block % len(VARIANTS)
                for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                    if variant == "bare":
                        times = _bare(args, rank, world)
                    else:
                        ckpt = (
                            os.path.join(tmp, f"ckpt-{block}")
                            if variant == "runtime+ckpt"
                            else None
                        )
                        times = _runtime(args, ckpt)
                    lines.append(block_line(args, block, variant, times))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text("\n".join(lines))


def block_line(
    args: argparse.Namespace, block: int, variant: str, times: list[tuple[float, float]]
) -> str:
    """``block variant samples/s CPU-us/sample`` of one block's timed window (a collective: every
    rank calls it; the CPU seconds are summed over the ranks)."""
    window = times[args.warmup - 1 :]
    samples = args.steps * args.global_batch_size
    wall = window[-1][0] - window[0][0]
    cpu = torch.tensor([window[-1][1] - window[0][1]], dtype=torch.float64)
    if args.device == "cuda":
        cpu = cpu.cuda()  # NCCL reduces device tensors only
    dist.all_reduce(cpu)
    return f"{block} {variant} {samples / wall} {cpu.item() / samples * 1e6}"


VARIANTS = ("bare", "runtime", "runtime+ckpt")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--blocks", type=int, default=6, help="rounds of (bare, runtime, runtime+ckpt)"
    )
    parser.add_argument("--steps", type=int, default=200, help="timed steps per block")
    parser.add_argument(
        "--warmup", type=int, default=20, help="untimed steps at the start of each block"
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--tmp", default=None, help="directory for checkpoints (default: system temp)"
    )
    args = parser.parse_args()
    resolve_workload_arguments(parser, args)

    report_blocks(args, _worker, VARIANTS, baseline="bare")


def report_blocks(args: argparse.Namespace, worker: Any, variants: Sequence[str], *, baseline: str,
                  note: str = "") -> None:  # fmt: skip
    """Run ``worker`` on ``args.nproc`` spawned ranks (it writes ``block variant samples/s
    CPU-us/sample [step-ms,step-ms,...]`` lines to the file it is given), print every block, then
    a table of medians and of per-block ratios against ``baseline``; with step times, their p50,
    p99 and maximum over every timed step too (they show stalls that medians hide)."""
    with tempfile.NamedTemporaryFile(dir=args.tmp, suffix=".txt") as out:
        mp.start_processes(worker, args=(args.nproc, free_port(), args, out.name), nprocs=args.nproc,
                           start_method="spawn")  # fmt: skip
        lines = Path(out.name).read_text().splitlines()
    width = max(len(v) for v in variants)
    per_block: dict[int, dict[str, tuple[float, float, list[float]]]] = {}
    for line in lines:
        block, variant, rate, cpu, *steps = line.split()
        times = [float(s) for s in steps[0].split(",")] if steps else []
        per_block.setdefault(int(block), {})[variant] = (float(rate), float(cpu), times)
        print(
            f"block {block}: {variant:{width}s} {float(rate):9.1f} samples/s  {float(cpu):7.1f} CPU-us/sample",
            flush=True,
        )
    print()
    where = (
        f"{args.nproc} x {torch.cuda.get_device_name()}, NCCL"
        if args.device == "cuda"
        else f"{args.nproc} gloo ranks"
    )
    what = f"{args.model}{', bf16 autocast' if args.bf16 else ''}, global batch {args.global_batch_size}"
    print(
        f"{what}; {where}; load average at the end: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores){note}"
    )
    timed = all(times for b in per_block.values() for _, _, times in b.values())
    print(
        f"| variant | samples/s (median) | ratio vs {baseline} | CPU-us per sample, both ranks (median) | "
        f"CPU ratio vs {baseline} |" + (" step ms p50 | p99 | max |" if timed else "")
    )
    print("|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if timed else ""))
    for variant in variants:
        median_rate = statistics.median(b[variant][0] for b in per_block.values())
        ratio = statistics.median(b[variant][0] / b[baseline][0] for b in per_block.values())
        median_cpu = statistics.median(b[variant][1] for b in per_block.values())
        cpu_ratio = statistics.median(b[variant][1] / b[baseline][1] for b in per_block.values())
        row = (
            f"| {variant} | {median_rate:.1f} | {ratio:.3f} | {median_cpu:.1f} | {cpu_ratio:.3f} |"
        )
        if timed:
            step_ms = sorted(t for b in per_block.values() for t in b[variant][2])
            row += f" {_percentile(step_ms, 0.5):.2f} | {_percentile(step_ms, 0.99):.2f} | {step_ms[-1]:.2f} |"
        print(row)


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


if __name__ == "__main__":
    main()
