"""Training stall per checkpoint: asynchronous vs synchronous, model state >= 500 MB.

One rank (the stall is rank 0's: it writes while the others wait at the outcome broadcast), an
MLP of 8 x Linear(4096, 4096) = 134 M float32 parameters = 537 MB of model state, plain SGD (no
optimizer state), a checkpoint every ``--every`` steps into a directory on the real disk (each
write is fsynced). Two measures per mode:

* on-thread stall: what the trainer reports to its observer (``on_checkpoint_saved.duration_s``)
  -- the training thread's time inside the checkpoint call (sync: serialise + hash + fsync +
  rename; async: CPU snapshot, plus any wait for the previous write still in flight);
* effective cost: (run time with checkpoints - run time without) / checkpoints, which also counts
  what the background writer takes from training (CPU, memory bandwidth) in async mode.

    python -m benchmarks.checkpoint_stall --steps 40 --every 10 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.runtime.observer import NullObserver
from elastic_trainer.train.config import TrainerConfig
from elastic_trainer.train.trainer import Trainer, TrainingJob


class _Random(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int, dim: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, dim, generator=generator)
        self.y = torch.randn(size, dim, generator=generator)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class _Recorder(NullObserver):
    def __init__(self) -> None:
        self.stalls: list[tuple[int, float, int]] = []

    def on_checkpoint_saved(self, *, step: int, duration_s: float, nbytes: int) -> None:
        self.stalls.append((step, duration_s, nbytes))


def run(
    mode: str, args: argparse.Namespace, directory: str
) -> tuple[float, list[tuple[int, float, int]]]:
    recorder = _Recorder()
    job = TrainingJob(
        model=lambda: nn.Sequential(*[nn.Linear(args.dim, args.dim) for _ in range(args.layers)]),
        dataset=lambda: _Random(256, args.dim),
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-4),
        loss=nn.MSELoss(),
    )
    config = TrainerConfig(
        global_batch_size=args.batch,
        max_steps=args.steps,
        epochs=10_000,
        # One more than the run: the final checkpoint (always synchronous) is not a periodic one.
        checkpoint=CheckpointConfig(
            directory=None if mode == "none" else directory,
            every=args.every,
            keep_last=1,
            async_write=mode == "async",
        ),
        log_every=10_000,
    )
    started = time.perf_counter()
    Trainer(config, job, observer=recorder).fit()
    elapsed = time.perf_counter() - started
    periodic = [s for s in recorder.stalls if s[0] < args.steps]
    final = [s for s in recorder.stalls if s[0] == args.steps]
    # The run time excludes the final (synchronous) checkpoint, which both modes pay alike.
    return elapsed - sum(d for _, d, _ in final), periodic


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--dir", default=None, help="checkpoint directory's parent (default: system temp)"
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    mb = args.layers * (args.dim * args.dim + args.dim) * 4 / 1e6
    print(f"model state {mb:.0f} MB, {args.steps} steps, checkpoint every {args.every}")

    totals: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    for repeat in range(args.repeats):
        for mode in ("none", "sync", "async"):
            with tempfile.TemporaryDirectory(dir=args.dir) as directory:
                elapsed, periodic = run(mode, args, directory)
            totals[mode].append(elapsed)
            if mode != "none":
                stalls[mode] += [d for _, d, _ in periodic]
            print(
                f"repeat {repeat} {mode:5s}: run {elapsed:7.2f} s, on-thread stalls "
                f"{', '.join(f'{d:.2f}' for _, d, _ in periodic) or '-'} s",
                flush=True,
            )

    checkpoints = args.steps // args.every - (1 if args.steps % args.every == 0 else 0)
    base = statistics.median(totals["none"])
    print()
    print(
        "| mode | on-thread stall per checkpoint, s (median) | effective cost per checkpoint, s |"
    )
    print("|---|---:|---:|")
    effective = {}
    for mode in ("sync", "async"):
        effective[mode] = (statistics.median(totals[mode]) - base) / checkpoints
        print(f"| {mode} | {statistics.median(stalls[mode]):.3f} | {effective[mode]:.3f} |")
    print()
    print(
        f"on-thread stall ratio async/sync: {statistics.median(stalls['async']) / statistics.median(stalls['sync']):.3f}"
    )
    print(f"effective cost ratio async/sync: {effective['async'] / effective['sync']:.3f}")


if __name__ == "__main__":
    main()
