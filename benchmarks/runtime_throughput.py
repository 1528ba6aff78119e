"""Steady-state throughput of the elastic-trainer runtime vs a bare DDP loop, side by side.

Same model (the example's SmallCNN), same synthetic data, same global batch, same optimizer,
2 processes on gloo. The bare loop is the textbook one: ``DistributedSampler`` + ``DataLoader`` +
``DDP`` + SGD. The runtime adds its elastic sampler, world-size-invariant loss scaling, one small
allreduce per step (global loss + stop flag), sample accounting and, in the ``runtime+ckpt``
variant, the default checkpoint every 100 steps (synchronous, rank 0).

    python benchmarks/runtime_throughput.py --blocks 6

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
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_trainer.config import TrainerConfig  # noqa: E402
from elastic_trainer.examples.synthetic_cnn import SmallCNN, SyntheticImages  # noqa: E402
from elastic_trainer.observer import NullObserver  # noqa: E402
from elastic_trainer.trainer import Trainer, TrainingJob  # noqa: E402


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    model = DDP(SmallCNN(args.width))
    dataset = SyntheticImages(args.dataset_size, seed=args.seed)
    sampler: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.global_batch_size // world, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    times: list[tuple[float, float]] = []
    epoch = 0
    while len(times) < args.warmup + args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            optimizer.step()
            times.append(_now())
            if len(times) >= args.warmup + args.steps:
                break
        epoch += 1
    return times


def _runtime(args: argparse.Namespace, checkpoint_dir: str | None) -> list[tuple[float, float]]:
    clock = _StepClock()
    job = TrainingJob(
        model=lambda: SmallCNN(args.width),
        dataset=lambda: SyntheticImages(args.dataset_size, seed=args.seed),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4),
        loss=nn.CrossEntropyLoss(),
    )
    config = TrainerConfig(global_batch_size=args.global_batch_size, seed=args.seed, epochs=10_000,
                           max_steps=args.warmup + args.steps, checkpoint_dir=checkpoint_dir, log_every=10_000)
    Trainer(config, job, observer=clock).fit()
    return clock.times


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """Both ranks run every variant in alternating blocks inside the same warm processes, so that
    noise from a shared machine hits all variants alike; rank 0 writes one line per block."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    lines = []
    try:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            for block in range(args.blocks):
                shift = block % len(VARIANTS)
                for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                    if variant == "bare":
                        times = _bare(args, rank, world)
                    else:
                        ckpt = os.path.join(tmp, f"ckpt-{block}") if variant == "runtime+ckpt" else None
                        times = _runtime(args, ckpt)
                    window = times[args.warmup - 1 :]
                    samples = args.steps * args.global_batch_size
                    wall = window[-1][0] - window[0][0]
                    cpu = torch.tensor([window[-1][1] - window[0][1]], dtype=torch.float64)
                    dist.all_reduce(cpu)  # CPU seconds of both ranks
                    lines.append(f"{block} {variant} {samples / wall} {cpu.item() / samples * 1e6}")
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text("\n".join(lines))


VARIANTS = ("bare", "runtime", "runtime+ckpt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=6, help="rounds of (bare, runtime, runtime+ckpt)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps at the start of each block")
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--dataset-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tmp", default=None, help="directory for checkpoints (default: system temp)")
    args = parser.parse_args()

    report_blocks(args, _worker, VARIANTS, baseline="bare")


def report_blocks(args: argparse.Namespace, worker: Any, variants: Sequence[str], *, baseline: str,
                  note: str = "") -> None:  # fmt: skip
    """Run ``worker`` on 2 spawned ranks (it writes ``block variant samples/s CPU-us/sample``
    lines to the file it is given), print every block, then a table of medians and of per-block
    ratios against ``baseline``."""
    with tempfile.NamedTemporaryFile(dir=args.tmp, suffix=".txt") as out:
        mp.start_processes(worker, args=(2, _free_port(), args, out.name), nprocs=2, start_method="spawn")
        lines = Path(out.name).read_text().splitlines()
    width = max(len(v) for v in variants)
    per_block: dict[int, dict[str, tuple[float, float]]] = {}
    for line in lines:
        block, variant, rate, cpu = line.split()
        per_block.setdefault(int(block), {})[variant] = (float(rate), float(cpu))
        print(f"block {block}: {variant:{width}s} {float(rate):9.1f} samples/s  {float(cpu):7.1f} CPU-us/sample", flush=True)
    print()
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (2 cores){note}")
    print(f"| variant | samples/s (median) | ratio vs {baseline} | CPU-us per sample, both ranks (median) | CPU ratio vs {baseline} |")
    print("|---|---:|---:|---:|---:|")
    for variant in variants:
        median_rate = statistics.median(b[variant][0] for b in per_block.values())
        ratio = statistics.median(b[variant][0] / b[baseline][0] for b in per_block.values())
        median_cpu = statistics.median(b[variant][1] for b in per_block.values())
        cpu_ratio = statistics.median(b[variant][1] / b[baseline][1] for b in per_block.values())
        print(f"| {variant} | {median_rate:.1f} | {ratio:.3f} | {median_cpu:.1f} | {cpu_ratio:.3f} |")

if __name__ == "__main__":
    main()
