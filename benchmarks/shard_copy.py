"""What the neighbour copy of sharded state costs per step (``state/neighbour_copy.py``): an FSDP2
MLP on gloo ranks of this machine, the same loop with the copy off, refreshed every step (the
default) and every ``--sparse`` steps, blocks alternated, side by side in one run.

Per mode: wall time per step (median over the blocks; rank 0's clock after a barrier), CPU time
per step summed over the ranks (``time.process_time``: every thread of each process, the
exchange thread's included) and the training thread's staging time per refresh (the only work
the copy adds on that thread). Ratios against "off" are printed, CPU ratios too.

    python -m benchmarks.shard_copy --dim 1024 --layers 4 --steps 100 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _model(dim: int, layers: int, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _block(args: argparse.Namespace, every: int, rank: int, world: int) -> dict[str, float]:
    from elastic_trainer.runtime.distributed import DistEnv
    from elastic_trainer.state import flat
    from elastic_trainer.state.local_shards import local_state
    from elastic_trainer.state.neighbour_copy import NeighbourCopy

    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                  restart_count=0, launched=True, device=torch.device("cpu"), backend="gloo")  # fmt: skip
    model = _model(args.dim, args.layers, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randn(args.batch, args.dim, generator=generator)
    copies = NeighbourCopy(
        lambda s: local_state(model, [optimizer], {}, step=s), env=env, every=every
    )
    for step in range(1, 4):  # warm-up (the optimizer state and the copy's buffers)
        model(batch).square().mean().backward()
        with copies.update(step):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    copies.wait()
    stage_before, refreshes_before = copies.stage_s, copies.refreshes
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(4, 4 + args.steps):
        model(batch).square().mean().backward()
        with copies.update(step):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    copies.wait()
    cpu = time.process_time() - cpu
    dist.barrier()
    wall = time.perf_counter() - wall
    refreshes = copies.refreshes - refreshes_before
    shard_bytes = flat.pack(local_state(model, [optimizer], {}, step=0)).total
    return {
        "wall_step_ms": 1e3 * wall / args.steps,
        "cpu_step_ms": 1e3 * cpu / args.steps,
        "stage_ms": 1e3 * (copies.stage_s - stage_before) / refreshes if refreshes else 0.0,
        "shard_mb": shard_bytes / 1e6,
    }


def _worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    world = args.world
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    modes = [("off", 0), ("every 1", 1), (f"every {args.sparse}", args.sparse)]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in modes}
    try:
        for _ in range(args.repeats):
            for name, every in modes:
                mine = _block(args, every, rank, world)
                everyone: list[Any] = [None] * world
                dist.all_gather_object(everyone, mine)
                results[name].append(
                    {
                        "wall_step_ms": everyone[0]["wall_step_ms"],
                        "cpu_step_ms": sum(r["cpu_step_ms"] for r in everyone),
                        "stage_ms": max(r["stage_ms"] for r in everyone),
                        "shard_mb": max(r["shard_mb"] for r in everyone),
                    }
                )
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sparse", type=int, default=4, help="the interval of the third mode")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(_worker, args=(args, os.path.join(tmp, "store"), out), nprocs=args.world)
        with open(out) as f:
            results = json.load(f)
    off = results["off"]
    base_wall = statistics.median(r["wall_step_ms"] for r in off)
    base_cpu = statistics.median(r["cpu_step_ms"] for r in off)
    print(
        f"FSDP2 MLP {args.layers} x Linear({args.dim}, {args.dim}), AdamW, {args.world} gloo ranks, "
        f"{args.steps} steps x {args.repeats} blocks per mode; shard per rank "
        f"{off[0]['shard_mb']:.1f} MB"
    )
    print(
        "| mode | wall per step (median) | CPU per step, all ranks (median) | wall ratio | CPU ratio | staging per refresh |"
    )
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        wall = statistics.median(r["wall_step_ms"] for r in runs)
        cpu = statistics.median(r["cpu_step_ms"] for r in runs)
        stage = statistics.median(r["stage_ms"] for r in runs)
        print(
            f"| {name} | {wall:.2f} ms | {cpu:.2f} ms | {wall / base_wall:.3f} | "
            f"{cpu / base_cpu:.3f} | {stage:.2f} ms |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
