"""What the step's control costs on its own gloo collective (the default since issue 30), per step.

    python -m benchmarks.control_cost --steps 2000 --blocks 4              # the example CNN's buffers
    python -m benchmarks.control_cost --steps 2000 --blocks 4 --buffers 0  # a model without buffers

Two gloo processes run :class:`~elastic_trainer.runtime.step_control.ControlChannel` the way the
loop does (``start`` before the backward, ``wait_before_update``, ``finish`` a step later) with no
model at all, in blocks that alternate with empty blocks; the CPU time of both processes (every
thread: gloo's included) per step is the control's cost, to set against a step's CPU time
(``benchmarks/launcher_e2e.py``). Riding on a gradient bucket saved this collective, but the
Python hook on every bucket it took cost more than it saved on large buckets (removed in issue 30;
``docs/design/steady-state.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rendezvous.etcd_server import free_port


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.runtime.step_control import ControlChannel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    env = read_env(
        environ={"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)},
        cuda_devices=0,
    )
    channel = ControlChannel(env)
    buffers = torch.randn(args.buffers) if args.buffers else None
    loss = torch.tensor(2.5)
    costs: dict[str, list[float]] = {"control": [], "empty": []}
    for block in range(args.blocks):
        for arm in ("control", "empty") if block % 2 == 0 else ("empty", "control"):
            dist.barrier()
            cpu = time.process_time()
            pending = None
            for step in range(args.steps):
                if arm == "empty":
                    continue
                current = channel.start(step, loss, global_samples=64, stop=False, buffers=buffers)
                channel.wait_before_update(current)
                if pending is not None:
                    channel.finish(pending)
                pending = current
            if pending is not None:
                channel.finish(pending)
            costs[arm].append(time.process_time() - cpu)
    both = [
        torch.tensor(costs["control"], dtype=torch.float64),
        torch.tensor(costs["empty"], dtype=torch.float64),
    ]
    for tensor in both:
        dist.all_reduce(tensor)  # both ranks' CPU
    if rank == 0:
        per_step = [
            (c - e) / args.steps * 1e6
            for c, e in zip(both[0].tolist(), both[1].tolist(), strict=True)
        ]
        results.put(per_step)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument(
        "--buffers",
        type=int,
        default=98,
        help="values of rank 0's buffers on the control (the example CNN's at width 16: 98; 0: none)",
    )
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(
        _worker, args=(2, free_port(), args, results), nprocs=2, start_method="spawn"
    )
    per_step = results.get(timeout=60)
    print(
        f"control on its own collective, {args.buffers} buffer values, 2 gloo ranks, load "
        f"{os.getloadavg()[0]:.1f}: CPU per step (both ranks) median {statistics.median(per_step):.0f} us "
        f"(blocks: {', '.join(f'{v:.0f}' for v in per_step)})"
    )


if __name__ == "__main__":
    main()
