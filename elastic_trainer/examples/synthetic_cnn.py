"""A small CNN with BatchNorm on a deterministic synthetic dataset: the runtime's example job.

Run it elastically on one or more nodes (each node runs the same command)::

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=demo \\
        --nnodes=1:2 --nproc-per-node=2 --max-restarts=3 \\
        -m elastic_trainer.examples.synthetic_cnn \\
        --max-steps 500 --epochs 2 --global-batch-size 64 \\
        --checkpoint-dir /shared/ckpt --checkpoint-every 50 --seed 0

or as a single process: ``python -m elastic_trainer.examples.synthetic_cnn --max-steps 20``.
The data (images and labels from a fixed random "teacher") are generated from ``--seed``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_trainer.metrics.choice import build_observer
from elastic_trainer.runtime import failures
from elastic_trainer.runtime.distributed import read_env, strip_local_rank_arg
from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.runtime.observer import TrainingObserver
from elastic_trainer.runtime.process_exit import exit_process
from elastic_trainer.runtime.settings import WorkerSettings
from elastic_trainer.train.config import (
    DEFAULT_CHECKPOINT_EVERY,
    CheckpointConfig,
    DDPOptions,
    TrainerConfig,
)
from elastic_trainer.train.loop import FaultHook
from elastic_trainer.train.trainer import Trainer, TrainingJob

log = logging.getLogger("elastic_trainer.examples.synthetic_cnn")
PROG = "synthetic_cnn"

CLASSES = 10


class SmallCNN(nn.Module):
    """conv-BN-ReLU x2, global average pool, linear classifier.

    ``batchnorm=False`` puts identities where the BatchNorms are: without SyncBatchNorm (CPU)
    batch statistics are per rank, the one part of a step that depends on the world size.
    """

    def __init__(self, width: int = 16, *, batchnorm: bool = True, dropout: float = 0.0) -> None:
        super().__init__()

        def norm(channels: int) -> nn.Module:
            return nn.BatchNorm2d(channels) if batchnorm else nn.Identity()

        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False),
            norm(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
            norm(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            *([nn.Dropout(dropout)] if dropout > 0 else []),
        )
        self.classifier = nn.Linear(2 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class SyntheticImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``size`` random 3x``side``x``side`` images labelled by a fixed, randomly initialised
    :class:`SmallCNN` teacher (so the task is learnable by the student architecture)."""

    def __init__(self, size: int, *, seed: int, side: int = 16) -> None:
        generator = torch.Generator().manual_seed(seed + 1_000_003)
        self.images = torch.randn(size, 3, side, side, generator=generator)
        fork = torch.random.fork_rng(devices=[])  # leave the caller's global RNG untouched
        with fork, torch.no_grad():
            torch.manual_seed(seed + 2_000_003)
            teacher = SmallCNN(8).eval()
            logits = teacher(self.images)
            # Standardised per class so that every class gets a fair share of the samples.
            self.labels = ((logits - logits.mean(0)) / logits.std(0)).argmax(dim=1)

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class Throttled:
    """Wraps an observer and sleeps after every step (``--throttle-ms``)."""

    def __init__(self, inner: TrainingObserver, seconds: float) -> None:
        self._inner = inner
        self._seconds = seconds

    def on_step(self, **kwargs: Any) -> None:
        self._inner.on_step(**kwargs)
        time.sleep(self._seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def evaluate(model: nn.Module, dataset: SyntheticImages, device: torch.device) -> float:
    """Mean cross-entropy of ``model`` over the whole dataset (call it in eval mode, under
    ``torch.no_grad()``): the "final loss", far less noisy than the loss of one mini-batch."""
    total = 0.0
    for start in range(0, len(dataset), 256):
        images = dataset.images[start : start + 256].to(device)
        labels = dataset.labels[start : start + 256].to(device)
        total += nn.functional.cross_entropy(model(images), labels, reduction="sum").item()
    return total / len(dataset)


def make_job(args: argparse.Namespace) -> TrainingJob:
    """The example's factories (also used by the benchmarks)."""
    return TrainingJob(
        model=lambda: SmallCNN(args.width, batchnorm=not args.no_batchnorm, dropout=args.dropout),
        dataset=lambda: SyntheticImages(args.dataset_size, seed=args.seed),
        optimizer=lambda params: torch.optim.SGD(
            params, lr=args.lr, momentum=0.9, weight_decay=1e-4
        ),
        evaluate=lambda model, step: {
            "eval_loss": evaluate(
                model, SyntheticImages(512, seed=args.seed), next(model.parameters()).device
            )
        },
        scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=max(args.max_steps or 1000, 1)
        ),
        loss=nn.CrossEntropyLoss(),
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m elastic_trainer.examples.synthetic_cnn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many optimizer steps"
    )
    parser.add_argument("--epochs", type=int, default=1, help="passes over the dataset (default 1)")
    parser.add_argument(
        "--global-batch-size", type=int, default=64, help="samples per step over all ranks"
    )
    parser.add_argument(
        "--micro-batch-size", type=int, default=None, help="cap per forward; the rest accumulates"
    )
    parser.add_argument(
        "--checkpoint-dir", default=None, help="shared directory for rank-0 checkpoints"
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=DEFAULT_CHECKPOINT_EVERY,
        help=f"steps between checkpoints (default {DEFAULT_CHECKPOINT_EVERY})",
    )
    parser.add_argument("--keep-last", type=int, default=3, help="checkpoints kept (default 3)")
    parser.add_argument(
        "--async-checkpoint", action="store_true", help="write checkpoints on a background thread"
    )
    parser.add_argument(
        "--jit-save",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="when a worker dies, a survivor checkpoints the last completed step (default: on, "
        "or ELASTIC_TRAINER_JIT_SAVE)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds weights, data and data order")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dataset-size", type=int, default=2048)
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv layer")
    parser.add_argument(
        "--no-batchnorm",
        action="store_true",
        help="identities instead of BatchNorm (makes steps exactly world-size invariant on CPU)",
    )
    parser.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="dropout before the classifier (random numbers in every step; resume stays bitwise)",
    )
    parser.add_argument(
        "--grad-clip-norm", type=float, default=None, help="clip gradients to this 2-norm"
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="full-loss evaluation on 512 samples every this many steps (rank 0 logs it)",
    )
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no")
    parser.add_argument("--sync-batchnorm", action="store_true", help="SyncBatchNorm (CUDA only)")
    parser.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--record-samples",
        metavar="DIR",
        default=None,
        help="append every step's dataset indices to DIR/samples-rank*-pid*.jsonl (audit)",
    )
    parser.add_argument(
        "--throttle-ms",
        type=float,
        default=0.0,
        help="sleep this long after every step: makes the tiny job last long enough to scale, "
        "kill or preempt it by hand (demos, tests)",
    )
    return parser.parse_args(list(argv))


def _configure_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
    )


def main(argv: Sequence[str] | None = None, *, fault_hook: FaultHook | None = None) -> int:
    """The example's worker; ``fault_hook`` is a test seam (``elastic_trainer.train.loop.FaultHook``)."""
    local_rank, rest = strip_local_rank_arg(sys.argv[1:] if argv is None else argv)
    args = parse_args(rest)
    _configure_logging()
    try:
        if args.dataset_size <= 0:
            raise ConfigError(f"--dataset-size: must be positive, got {args.dataset_size}")
        if args.width <= 0:
            raise ConfigError(f"--width: must be positive, got {args.width}")
        if not 0.0 <= args.dropout < 1.0:
            raise ConfigError(f"--dropout: must be in [0, 1), got {args.dropout}")
        if args.throttle_ms < 0:
            raise ConfigError(f"--throttle-ms: must be >= 0, got {args.throttle_ms}")
        config = TrainerConfig(
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            seed=args.seed,
            epochs=args.epochs,
            max_steps=args.max_steps,
            checkpoint=CheckpointConfig(
                directory=args.checkpoint_dir,
                every=args.checkpoint_every,
                keep_last=args.keep_last,
                async_write=args.async_checkpoint,
                jit_save=args.jit_save,
            ),
            grad_clip_norm=args.grad_clip_norm,
            eval_every=args.eval_every,
            mixed_precision=args.mixed_precision,
            sync_batchnorm=args.sync_batchnorm,
            zero_redundancy=args.zero,
            ddp=DDPOptions(),
            log_every=args.log_every,
            num_workers=args.num_workers,
            record_samples_dir=args.record_samples,
        )
        settings = WorkerSettings.from_environ()  # the worker's environment, parsed once
        env = read_env(local_rank_arg=local_rank, backend=config.backend)
        observer = build_observer(settings)
        if args.throttle_ms > 0:
            observer = Throttled(observer, args.throttle_ms / 1000)
        trainer = Trainer(
            config,
            make_job(args),
            observer=observer,
            env=env,
            settings=settings,
            fault_hook=fault_hook,
        )
        result = trainer.fit()
    except Exception as exc:  # noqa: BLE001 - classified, recorded for the launcher, reported once
        return failures.exit_after(exc, prog=PROG)
    if trainer.elastic is None:  # a spare when the job finished: it trained nothing to evaluate
        return result.exit_code
    if env.is_rank0:
        dataset = trainer.dataset
        if not isinstance(dataset, SyntheticImages):
            raise TypeError(
                f"the example's dataset is {type(dataset).__name__}, not SyntheticImages"
            )
        trainer.model.eval()
        with torch.no_grad():
            eval_loss = (
                None if result.stopped_by_signal else evaluate(trainer.model, dataset, env.device)
            )
        print(
            f"final step {result.step} epoch {result.epoch} loss {result.loss} eval_loss {eval_loss} "
            f"checkpoint {result.checkpoint} stopped_by_signal {result.stopped_by_signal}",
            flush=True,
        )
    return result.exit_code


def _exit(code: int) -> None:
    """Exit without interpreter teardown, whatever the outcome.

    By now the Trainer has destroyed the process group. Tearing down torch's C++ state (gloo)
    occasionally aborts (``terminate called without an active exception``, SIGABRT): after a
    failure that would replace the clear error code and message with a crash report, and after a
    *successful* run the agent would count the abort as a failure and restart the finished group.
    """
    exit_process(code)


if __name__ == "__main__":
    _exit(main())
