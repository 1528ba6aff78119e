"""Sharded (FSDP2) state, two gloo ranks on this machine (``--device cuda``: NCCL, one rank per
GPU, at most two): what checkpoints cost the training thread, and what the library's steady state
costs next to a bare FSDP2 loop.

* ``stall``: an MLP of ``--layers`` x Linear(dim, dim), each layer and the model under
  ``fully_shard``, AdamW (state = 3x the parameters), a sharded checkpoint every ``--every``
  steps into a directory on the real disk (every file fsynced). Per mode: the training thread's
  time inside ``CheckpointManager.save`` (max over the ranks, median over the saves), and
  the effective cost per save ((run time with checkpoints - without) / saves), which also counts
  what the background writer takes from training. Modes run one after the other in one process
  pair, in the order none, async, sync, repeated ``--repeats`` times.
* ``steady``: the same loop with the library at its defaults (``TrainingState`` over the sharded
  model, ``CheckpointManager`` with a checkpoint every 100 steps, asynchronous; the sampler's
  plan and the per-step reseeding of ``runtime/rng.py``) against a bare FSDP2 loop (no
  checkpoints, seeded once); CPU time per step summed over the ranks, and wall time. With
  ``--elastic`` a third contender: the same step through the own-loop API (``Elastic`` over the
  sharded model: the state owner's routing, ``CheckpointManager`` with sharded checkpoints every
  100 steps, the step's control carried by a reduce-scatter, the sampler), what
  ``Trainer(TrainerConfig(fsdp=...))`` runs. The modes alternate in blocks of
  ``--checkpoint-every`` steps (bare, ours, elastic), ``--steps`` per mode and repeat: a change of
  the machine's load reaches every mode alike, and a block's checkpoint write is finished (its CPU
  counted, its wait not) before the next mode's block starts.

    python -m benchmarks.sharded_checkpoint stall --dim 2048 --layers 8 --steps 24 --every 8 --repeats 2
    python -m benchmarks.sharded_checkpoint steady --dim 512 --layers 4 --steps 300 --repeats 3
    python -m benchmarks.sharded_checkpoint steady --elastic --dim 512 --layers 4 --steps 300 --repeats 3
    python -m benchmarks.sharded_checkpoint steady --elastic --control collective --dim 512 --layers 4 --steps 300 --repeats 3
    python -m benchmarks.sharded_checkpoint stall --device cuda --dim 4096 --layers 8 --steps 24 --every 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _device(args: argparse.Namespace, rank: int) -> torch.device:
    return torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")


def _sync(device: torch.device) -> None:
    """Wait for the GPU before a clock is read (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(dim: int, layers: int, device: torch.device, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)])
    model.to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _Checkpoints:
    """The library's checkpoint manager over the sharded state (``TrainingState`` routes the
    FSDP2 model through DCP), saving the step it is given."""

    def __init__(self, manager: Any, state: Any) -> None:
        self.manager, self.state = manager, state

    def save(self, step: int) -> None:
        """Checkpoint ``step`` when the manager finds it due (every ``every`` steps)."""
        self.state.step = step
        self.manager.save(step)

    def close(self) -> None:
        """Wait for the background write."""
        self.manager.close(grace_s=600.0)


def _manager(
    directory: str,
    every: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: Any,
    *,
    async_write: bool = True,
) -> _Checkpoints:
    from elastic_trainer import CheckpointConfig, CheckpointManager, TrainingState
    from elastic_trainer.runtime.distributed import read_env

    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = torch.cuda.device_count() if dist.get_backend() == "nccl" else 0  # --device cuda
    env = read_env(
        environ={"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)},
        cuda_devices=cuda,
    )
    state = TrainingState(
        {"model": model, "optimizer": optimizer, "sampler": sampler}, env=env, seed=0
    )
    manager = CheckpointManager(
        CheckpointConfig(directory=directory, every=every, async_write=async_write, keep_last=2),
        env=env,
        state=state,
        fingerprint={"seed": 0},
    )
    return _Checkpoints(manager, state)


def _stall(rank: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from elastic_trainer.runtime.sampler import ElasticSampler

    device = _device(args, rank)
    model = _model(args.dim, args.layers, device, args.world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
    batch = batch.to(device)
    sampler = ElasticSampler(10_000, args.batch * args.world)
    managers = {
        mode: _manager(  # due at every step: the loop below chooses which steps it saves
            str(root / mode), 1, model, optimizer, sampler, async_write=mode == "async"
        )
        for mode in ("async", "sync")
    }
    for _ in range(3):  # warm-up: allocator, FSDP's lazy init, AdamW's state
        _step(model, optimizer, batch)
    results: dict[str, dict[str, list[float]]] = {
        m: {"total": [], "stall": []} for m in ("none", "async", "sync")
    }
    for _ in range(args.repeats):
        for mode in ("none", "async", "sync"):
            dist.barrier()
            started = time.perf_counter()
            for step in range(1, args.steps + 1):
                _step(model, optimizer, batch)
                if mode != "none" and step % args.every == 0:
                    _sync(device)  # the stall is the save's own time, not the queued steps'
                    inside = time.perf_counter()
                    managers[mode].save(step + 10_000 * len(results[mode]["total"]))
                    _sync(device)
                    results[mode]["stall"].append(time.perf_counter() - inside)
            if mode != "none":
                managers[mode].close()  # the last background write is part of this mode's cost
            _sync(device)
            results[mode]["total"].append(time.perf_counter() - started)
    nbytes = (
        sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    )  # params + AdamW's two moments
    return {"rank": rank, "results": results, "state_bytes_per_rank": nbytes // args.world}


def _steady(rank: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from elastic_trainer.runtime import rng
    from elastic_trainer.runtime.sampler import ElasticSampler

    device = _device(args, rank)
    model = _model(args.dim, args.layers, device, args.world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(4096, args.dim, generator=torch.Generator().manual_seed(0)).to(device)
    sampler = ElasticSampler(len(data), args.batch * args.world, seed=0)
    manager = _manager(str(root / "steady"), args.checkpoint_every, model, optimizer, sampler)
    for i in range(5):  # warm-up: allocator, FSDP's lazy init, AdamW's state
        _step(model, optimizer, data[i * args.batch :][: args.batch])
    modes = ("bare", "ours", "elastic") if args.elastic else ("bare", "ours")
    cpu: dict[str, list[float]] = {m: [0.0] * args.repeats for m in modes}
    wall: dict[str, list[float]] = {m: [0.0] * args.repeats for m in modes}
    elastic = _elastic_steps(args, model, optimizer, data, root) if args.elastic else None
    run = None
    for _ in range(5 if elastic is not None else 0):  # its setup and first steps, untimed
        run = next(elastic)
    # Short blocks, alternated (each mode's checkpoint interval: one save per block), so that a
    # change of the machine's load reaches every mode alike. A block ends when its last save is
    # written: the CPU of that write is its mode's (not the next block's), its wait is no step.
    block = min(args.checkpoint_every, args.steps)
    step = bare_step = 0
    for repeat in range(args.repeats):
        done = 0
        while done < args.steps:
            count = min(block, args.steps - done)
            for mode in modes:
                dist.barrier()
                started, started_cpu = time.perf_counter(), time.process_time()
                for _ in range(count):
                    if mode == "elastic" and elastic is not None:
                        run = next(elastic)
                        continue
                    if mode == "bare":
                        batch = data[(bare_step * args.batch) % len(data) :][: args.batch]
                        _step(model, optimizer, batch)
                        bare_step += 1
                        continue
                    if sampler.epoch_done:
                        sampler.set_epoch(sampler.epoch + 1)
                    plan = sampler.plan(sampler.cursor, rank, args.world)
                    rng.seed_step(0, rank, step, device)
                    _step(model, optimizer, data[list(plan.micro_batches[0].indices)])
                    sampler.advance(plan)
                    step += 1
                    manager.save(step)
                _sync(device)
                wall[mode][repeat] += time.perf_counter() - started
                if mode == "ours":
                    manager.close()
                if mode == "elastic" and run is not None:
                    while run.loop.checkpoints.writing:
                        time.sleep(0.002)
                cpu[mode][repeat] += time.process_time() - started_cpu
            done += count
    if elastic is not None:
        elastic.close()  # leaves the run after its last measured step (no final save timed)
    return {"rank": rank, "cpu": cpu, "wall": wall}


def _elastic_steps(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: torch.Tensor,
    root: Path,
) -> Any:
    """A generator that runs one step of the own-loop API over the sharded model per ``next``
    (and returns the run)."""
    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.runtime.settings import WorkerSettings
    from elastic_trainer.state.neighbour_copy import NeighbourCopyConfig
    from elastic_trainer.train.elastic import Elastic

    world, rank = dist.get_world_size(), dist.get_rank()
    env = read_env(
        environ={"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)},
        cuda_devices=torch.cuda.device_count() if dist.get_backend() == "nccl" else 0,
    )
    run = Elastic(
        model,
        len(data),
        global_batch_size=args.batch * world,
        max_steps=args.repeats * args.steps + 6,
        epochs=10**6,
        checkpoint_dir=str(root / "elastic"),
        checkpoint_every=args.checkpoint_every,
        log_every=10**9,
        # The neighbour copy (on by default for the just-in-time save) has its own benchmark,
        # benchmarks/shard_copy.py: this one measures the rest of the own-loop API.
        shard_copy=NeighbourCopyConfig(every=0),
        settings=WorkerSettings(control_carrier=args.control == "carried"),
        env=env,
    )
    for step in run:
        with step:
            for micro in step:
                step.backward(model(data[list(micro.indices)]).square().mean() * step.weight)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        yield run


def _worker(rank: int, args: argparse.Namespace, root: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    backend = "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(
        backend, init_method=f"file://{root}/store", rank=rank, world_size=args.world
    )
    result = (_stall if args.what == "stall" else _steady)(rank, args, Path(root))
    Path(root, f"result-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _report_stall(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    modes = ("none", "async", "sync")
    totals = {
        m: [max(r["results"][m]["total"][i] for r in results) for i in range(args.repeats)]
        for m in modes
    }
    stalls = {
        m: [max(vals) for vals in zip(*(r["results"][m]["stall"] for r in results), strict=True)]
        for m in ("async", "sync")
    }
    saves = args.steps // args.every
    print(
        f"state per rank: {results[0]['state_bytes_per_rank'] / 1e6:.0f} MB (params + AdamW), {args.world} ranks "
        f"on {args.device}, "
        f"{saves} saves per run, {args.repeats} repeats"
    )
    for mode in ("async", "sync"):
        later = (
            stalls[mode][1:] if len(stalls[mode]) > 1 else stalls[mode]
        )  # the first save allocates buffers
        effective = statistics.median(
            (t - n) / saves for t, n in zip(totals[mode], totals["none"], strict=True)
        )
        print(
            f"{mode:>5}: on-thread stall median {statistics.median(later) * 1e3:.1f} ms "
            f"(first save {stalls[mode][0] * 1e3:.1f} ms), effective cost per save {effective * 1e3:.1f} ms"
        )
    ratio = statistics.median(stalls["async"][1:] or stalls["async"]) / statistics.median(
        stalls["sync"][1:] or stalls["sync"]
    )
    print(f"async stall / sync stall: {ratio * 100:.1f} % (target <= 5 %)")


def _report_steady(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    modes = ("bare", "ours", "elastic") if args.elastic else ("bare", "ours")
    print(
        "load average before / after: "
        + " / ".join(" ".join(f"{x:.2f}" for x in load) for load in args.load)
    )
    cpu = {
        m: [sum(r["cpu"][m][i] for r in results) / args.steps for i in range(args.repeats)]
        for m in modes
    }
    wall = {
        m: [max(r["wall"][m][i] for r in results) / args.steps for i in range(args.repeats)]
        for m in modes
    }
    for mode in modes:
        print(
            f"{mode:>4}: CPU per step (all ranks) median {statistics.median(cpu[mode]) * 1e3:.2f} ms, wall per step "
            f"median {statistics.median(wall[mode]) * 1e3:.2f} ms; per repeat CPU "
            f"{' '.join(f'{c * 1e3:.1f}' for c in cpu[mode])}"
        )
    print(
        f"ours / bare: CPU {statistics.median(cpu['ours']) / statistics.median(cpu['bare']):.3f}x (target <= 1.03), "
        f"throughput {statistics.median(wall['bare']) / statistics.median(wall['ours']):.3f}"
    )
    if args.elastic:
        print(
            f"elastic / bare: CPU {statistics.median(cpu['elastic']) / statistics.median(cpu['bare']):.3f}x "
            f"(target <= 1.03), throughput "
            f"{statistics.median(wall['bare']) / statistics.median(wall['elastic']):.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("stall", "steady"))
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=8, help="stall: steps between checkpoints")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        help="steady: the library's checkpoint interval (default 100, its default)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="steady: also the own-loop API (Elastic) over the sharded model",
    )
    parser.add_argument(
        "--control",
        choices=("carried", "collective"),
        default="carried",
        help="steady --elastic: the step's control on a reduce-scatter (the default) or on its "
        "own collective (ELASTIC_TRAINER_CONTROL_CARRIER=0)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--world", type=int, default=None, help="ranks (default: 2; on cuda at most one per GPU)"
    )
    parser.add_argument(
        "--dir", default=None, help="where checkpoints go (default: the system temporary directory)"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    args.world = args.world or min(2, gpus)
    if args.world < 1 or args.world > gpus:
        parser.error(f"--world: must be 1..{gpus} on {args.device}, got {args.world}")
    with tempfile.TemporaryDirectory(
        dir=os.path.abspath(args.dir) if args.dir else None, prefix="bench-sharded-"
    ) as root:
        args.load = [os.getloadavg()]
        mp.spawn(_worker, args=(args, root), nprocs=args.world, join=True)
        args.load.append(os.getloadavg())
        results = [
            json.loads(Path(root, f"result-{rank}.json").read_text()) for rank in range(args.world)
        ]
    (_report_stall if args.what == "stall" else _report_steady)(results, args)


if __name__ == "__main__":
    main()
