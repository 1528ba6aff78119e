"""CPU cost of a Python DDP communication hook in a 2-rank gloo job: no hook against torch's
stock Python ``allreduce_hook``, side by side. Why elastic-trainer registers none (issue 30: its
own timing hook, measured here before, was removed; ``benchmarks/RESULTS.md`` keeps those rows).

Each rank holds the model once per arm (same weights; DDP on the default gloo group) and runs
blocks of ``--steps`` forward/backward passes per arm, the arm order reversed every block; the
CPU seconds of the process (all threads: gloo's, where the hooks' callbacks run, included) per
pass are compared with the no-hook arm of the same block. "aa" is a second no-hook model: the
noise floor. Rank 0 prints the medians over blocks.

``--device cuda`` runs one NCCL rank per GPU and reports
wall time per pass, the GPU synchronised at the end of each block: with ``--model buckets``
(20 linear layers of 2048x2048, one 16 MB bucket each, batch 8) the GPU kernels are tiny, so
the pass is bound by the host and the wall time is the host's cost, bucket hooks included.

Usage::

    python -m benchmarks.hook_cost                    # tiny model: the hooks' fixed cost dominates
    python -m benchmarks.hook_cost --model example    # the runtime example's CNN (width 32, batch 64)
    python -m benchmarks.hook_cost --device cuda --model buckets --blocks 12 --steps 100
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

ARMS = ("off", "aa", "torch-hook")


def _model_and_batch(kind: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "tiny":
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )
        return model, torch.randn(8, 16)
    if kind == "buckets":
        return torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(20))), torch.randn(
            8, 2048
        )
    from elastic_trainer.examples.synthetic_cnn import SmallCNN

    return SmallCNN(32), torch.randn(64, 3, 16, 16)


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    from benchmarks.workloads import init_worker

    init_worker(rank, args.nproc, port, args)
    cuda = args.device == "cuda"
    base, x = _model_and_batch(args.model)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    base, x = base.to(device), x.to(device)
    models: dict[str, Any] = {}
    for arm in ARMS:
        ddp = DDP(copy.deepcopy(base), device_ids=[rank] if cuda else None, bucket_cap_mb=16)
        if arm == "torch-hook":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        models[arm] = ddp
    # CPU: this process's CPU seconds (gloo's threads included). CUDA: wall seconds up to the end
    # of the block's GPU work (a host-bound pass: the host's cost; CPU time would count the spin).
    clock = time.perf_counter if cuda else time.process_time
    cost: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for block in range(args.blocks):
        for arm in ARMS if block % 2 == 0 else ARMS[::-1]:
            ddp = models[arm]
            for _ in range(5):
                ddp(x).sum().backward()
            if cuda:
                torch.cuda.synchronize()
            started = clock()
            for _ in range(args.steps):
                ddp(x).sum().backward()
            if cuda:
                torch.cuda.synchronize()
            cost[arm].append((clock() - started) / args.steps)
    if rank == 0:
        ranks = (
            f"{args.nproc} NCCL rank(s) on {torch.cuda.get_device_name()}"
            if cuda
            else "2 gloo ranks"
        )
        print(
            f"model {args.model}, {ranks}, OMP_NUM_THREADS=1, {args.blocks} blocks x {args.steps} passes; "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        what = "wall" if cuda else "CPU"
        print(f"| arm | {what} us per pass (median) | extra vs off, us (median of blocks) |")
        print("|---|---:|---:|")
        for arm in ARMS:
            extra = statistics.median(a - b for a, b in zip(cost[arm], cost["off"], strict=True))
            print(
                f"| {arm} | {statistics.median(cost[arm]) * 1e6:.1f} | {extra * 1e6:.1f} |",
                flush=True,
            )
    dist.destroy_process_group()
    from elastic_trainer.runtime.process_exit import exit_process

    exit_process(0)  # not through interpreter shutdown, where gloo can abort (see process_exit)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: 2 gloo ranks; cuda: one NCCL rank per GPU",
    )
    parser.add_argument(
        "--model",
        choices=("tiny", "example", "buckets"),
        default="tiny",
        help="buckets: 20 layers, one bucket each (host-bound on a GPU)",
    )
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--steps", type=int, default=400, help="passes per arm and block")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args.nproc = torch.cuda.device_count() if args.device == "cuda" else 2
    mp.start_processes(_worker, args=(port, args), nprocs=args.nproc, start_method="spawn")


if __name__ == "__main__":
    main()
