"""Steady-state cost of just-in-time (JIT) saving: the runtime with JIT on vs off, side by side.

JIT adds to every step: an uncontended lock around the update, a copy of the model's buffers
(BatchNorm statistics: a few KB) carried from rank 0 in the step's control allreduce, which
starts right after the last forward (overlapping the backward) and must have completed before
the update is applied (so a just-in-time snapshot never pairs step N's weights with another
step's buffers); after the backward that wait is usually over at once. Same job as ``runtime_throughput.py`` (the example's SmallCNN, 2
processes, gloo, checkpoints in a temporary directory every 100 steps), the two variants in
alternating blocks inside the same two warm processes; reported: median throughput, median of
the per-block ratios, and the CPU time per sample (robust to a shared machine).

    python -m benchmarks.jit_overhead --blocks 8
    python -m benchmarks.jit_overhead --blocks 8 --aa   # A/A: the same code twice, for the noise floor
    python -m benchmarks.jit_overhead --micro           # per-step added work, one process, no noise

On a shared machine the end-to-end ratio can drown in noise (check it against ``--aa``);
``--micro`` times what JIT adds to a step in isolation: the buffer copy, the wider control
tensor, the guard and the step-boundary bookkeeping.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.runtime_throughput import _runtime, block_line, report_blocks
from benchmarks.workloads import add_workload_arguments, init_worker, resolve_workload_arguments
from elastic_trainer.runtime.settings import ENV_JIT_SAVE

VARIANTS = ("jit-off", "jit-on")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    init_worker(rank, world, port, args)
    lines = []
    try:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            for block in range(args.blocks):
                order = VARIANTS if block % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    os.environ[ENV_JIT_SAVE] = "1" if variant == "jit-on" and not args.aa else "0"
                    times = _runtime(args, os.path.join(tmp, f"{variant}-{block}"))
                    lines.append(block_line(args, block, variant, times))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text("\n".join(lines))


def _micro(args: argparse.Namespace) -> None:
    import time

    from elastic_trainer.examples.synthetic_cnn import SmallCNN
    from elastic_trainer.state.buffers import AuthoritativeBuffers
    from elastic_trainer.state.guard import StateGuard

    torch.set_num_threads(1)
    model, guard = SmallCNN(args.width), StateGuard()
    loss, stop = torch.tensor(1.0), torch.tensor(0.0)

    def timed(fn: object, n: int = 20_000) -> float:
        fn()  # type: ignore[operator]
        start = time.perf_counter()
        for _ in range(n):
            fn()  # type: ignore[operator]
        return (time.perf_counter() - start) / n * 1e6

    def guarded() -> None:
        with guard.update():
            pass

    rows = []
    for rank in (0, 1):
        buffers = AuthoritativeBuffers(model, rank=rank, world_size=2)
        contribution = buffers.capture()
        assert contribution is not None
        rows.append(
            (f"buffer copy (rank {rank}, {contribution.numel()} values)", timed(buffers.capture))
        )
    rows.append(
        (
            "control tensor with buffers",
            timed(lambda: torch.cat([torch.stack([loss, stop]).double(), contribution])),
        )
    )
    rows.append(
        ("control tensor without (as with JIT off)", timed(lambda: torch.stack([loss, stop])))
    )
    rows.append(("update guard (uncontended lock)", timed(guarded)))
    rows.append(("step boundary (stall bookkeeping)", timed(guard.boundary)))
    print(f"SmallCNN width {args.width}, one thread")
    print("| per-step work | µs |")
    print("|---|---:|")
    for name, micros in rows:
        print(f"| {name} | {micros:.2f} |")
    added = rows[1][1] + rows[2][1] - rows[3][1] + rows[4][1] + rows[5][1]
    print(f"added per step on a rank other than 0: {added:.1f} µs")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--blocks", type=int, default=8, help="rounds of (jit-off, jit-on), order alternating"
    )
    parser.add_argument("--steps", type=int, default=200, help="timed steps per block")
    parser.add_argument(
        "--warmup", type=int, default=20, help="untimed steps at the start of each block"
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--tmp", default=None, help="directory for checkpoints (default: system temp)"
    )
    parser.add_argument(
        "--aa", action="store_true", help="A/A control: JIT off in both variants (the noise floor)"
    )
    parser.add_argument(
        "--micro", action="store_true", help="time the per-step additions in one process"
    )
    args = parser.parse_args()
    resolve_workload_arguments(parser, args)
    if args.micro:
        _micro(args)
        return

    report_blocks(
        args,
        _worker,
        VARIANTS,
        baseline="jit-off",
        note="; A/A: JIT off in both" if args.aa else "",
    )


if __name__ == "__main__":
    main()
