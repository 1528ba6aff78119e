"""Your own training loop, elastic: a plain DDP loop, as the DDP guides write it, plus a few lines.

    elastic-trainer run --nproc-per-node 2 -m elastic_trainer.examples.own_loop --max-steps 200 \\
        --checkpoint-dir ./ckpt
    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=job-1 --nnodes=1:2 \\
        --nproc-per-node=2 --max-restarts=3 -m elastic_trainer.examples.own_loop --max-steps 200 \\
        --checkpoint-dir ./ckpt

A character-level language model (embedding, GRU, dropout) on a seeded synthetic text. The loop is
the user's: two optimizers (AdamW for the network, SGD for the embedding), a loss that needs an
extra input (a mask of the positions to score), gradient clipping, a GradScaler, evaluation every
``--eval-every`` steps and a metric of its own. The lines marked ``# elastic:`` are all it takes to
get exact resume of model, optimizers, scheduler, scaler, sampler and random numbers (onto each
rank's own device), exactly-once data at any world size, periodic asynchronous checkpoints, the
SIGTERM checkpoint, the just-in-time save of the last step when a worker dies, and metrics. Under
``elastic-trainer run`` a peer's failure is healed in place: the surviving processes keep their
model and optimizers, re-form the group and go on (``ElasticGroup``); only a process that died is
started again, and it takes its state from a live peer.

Streams: the elastic sampler hands out positions in each epoch's global order, and a checkpoint
holds the epoch and the count of samples consumed (the cursor), never the data. A map-style
dataset maps a position to a sample. For an iterable dataset, exactly-once means: every position
of an epoch is trained once, provided the stream, re-created after a restart, yields the same
samples in the same order (a deterministic, replayable stream that can skip to the cursor); see
:class:`Stream` (``--stream``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence

import torch
from prometheus_client import Counter
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, IterableDataset

from elastic_trainer.checkpoint.config import CheckpointConfig  # elastic
from elastic_trainer.checkpoint.files import model_signature  # elastic
from elastic_trainer.checkpoint.manager import CheckpointManager  # elastic
from elastic_trainer.runtime import failures
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.process_exit import exit_process
from elastic_trainer.runtime.sampler import ElasticSampler, StepPlan, split_evenly  # elastic
from elastic_trainer.runtime.settings import WorkerSettings  # elastic
from elastic_trainer.train.elastic_group import ElasticGroup  # elastic
from elastic_trainer.train.loop import ElasticLoop
from elastic_trainer.train.trainer import build_observer  # elastic

PROG = "own_loop"
VOCAB = 32
log = logging.getLogger("elastic_trainer.examples.own_loop")

TOKENS = Counter("own_loop_tokens_total", "Tokens this rank trained on (a metric of the user's own)")
"""In a worker under ``elastic-trainer run`` prometheus-client writes to the launcher's directory:
your own metrics appear on the node's endpoint beside the runtime's."""


def corpus(seed: int, length: int) -> torch.Tensor:
    """A seeded synthetic text with structure to learn: a random walk over the alphabet."""
    generator = torch.Generator().manual_seed(seed + 7)
    steps = torch.randint(-2, 3, (length,), generator=generator)
    return torch.cumsum(steps, 0).remainder(VOCAB)


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i``: ``context`` characters and the next ones (a map-style dataset)."""

    def __init__(self, text: torch.Tensor, context: int) -> None:
        self.text, self.context = text, context

    def __len__(self) -> int:
        return (len(self.text) - 1) // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.context
        return self.text[start : start + self.context], self.text[start + 1 : start + self.context + 1]


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The same windows as a stream: deterministic and replayable, so it can skip to a cursor."""

    def __init__(self, windows: Windows, order: Sequence[int]) -> None:
        self.windows, self.order = windows, order

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in self.order:
            yield self.windows[index]

    def from_position(self, position: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The stream from the ``position``-th sample of its epoch (what a restart resumes at)."""
        iterator = iter(self)
        for _ in range(position):
            next(iterator)
        return iterator


class CharLM(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embedding(tokens))
        return self.head(self.dropout(hidden))


def masked_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions ``mask`` selects (a loss with an extra input)."""
    losses = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    weights = mask.reshape(-1).float()
    return (losses * weights).sum() / weights.sum().clamp(min=1.0)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m elastic_trainer.examples.{PROG}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the dataset (default 3)")
    parser.add_argument("--global-batch-size", type=int, default=32, help="samples per step over all ranks")
    parser.add_argument("--checkpoint-dir", default=None, help="directory every node shares")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights, the data order and every step")
    parser.add_argument("--eval-every", type=int, default=50, help="evaluate every this many steps")
    parser.add_argument("--stream", action="store_true", help="read the data as an iterable stream")
    parser.add_argument("--record-samples", metavar="DIR", default=None, help="audit: every step's indices")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--throttle-ms", type=float, default=0.0,
                        help="sleep after every step: long enough to watch, kill or scale by hand (demos, tests)")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {os.environ.get('RANK', '0')}] "
                                                   "%(levelname)s %(name)s: %(message)s")
    try:
        return train(args)
    except Exception as exc:  # noqa: BLE001 - one line (or the traceback once) for the launcher
        return failures.exit_after(exc, prog=PROG)


def train(args: argparse.Namespace) -> int:
    settings = WorkerSettings.from_environ()  # elastic: the worker's environment, parsed once
    # elastic: forms the process group (the DDP guides' init_process_group) and, under
    # elastic-trainer run, heals it in place when a peer fails: this process keeps its state.
    with ElasticGroup(settings) as group:
        env = group.env  # rank, world size and device from torchrun
        torch.manual_seed(args.seed)  # identical initial weights on every rank
        model = CharLM(width=32, dropout=0.1).to(env.device)
        body = [p for name, p in model.named_parameters() if not name.startswith("embedding")]
        optimizer = torch.optim.AdamW(body, lr=3e-3, weight_decay=0.01)
        embedding_optimizer = torch.optim.SGD(model.embedding.parameters(), lr=0.1, momentum=0.9)
        windows = Windows(corpus(args.seed, 40_000), context=32)
        held_out = Windows(corpus(args.seed + 1, 4_000), context=32)
        sampler = ElasticSampler(len(windows), args.global_batch_size, seed=args.seed)  # elastic: not DistributedSampler
        total = args.epochs * len(sampler) if args.max_steps is None else min(args.max_steps, args.epochs * len(sampler))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        scaler = torch.amp.GradScaler(env.device.type, enabled=env.device.type == "cuda")
        observer = build_observer(settings)  # elastic: metrics (none outside elastic-trainer run)
        for attempt in group.attempts():  # elastic: once, and again after each in-place heal
            with attempt:  # elastic: a peer's failure is healed here, then the next attempt goes on
                env = attempt.env  # elastic: the rank and world size change with a heal
                ddp = attempt.wrap(  # elastic: allreduce timing; the old group's DDP is let go after a heal
                    DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                        init_sync=attempt.ddp_init_sync),  # elastic: no broadcast when a peer's state comes next
                    observer)
                checkpoints = CheckpointManager(  # elastic: everything it saves and restores, by name
                    CheckpointConfig(directory=args.checkpoint_dir, every=args.checkpoint_every, async_write=True),
                    env=env, settings=settings, observer=observer, fence=attempt.fence,
                    states={"model": model, "optimizer": optimizer, "embedding_optimizer": embedding_optimizer,
                            "scheduler": scheduler, "scaler": scaler, "sampler": sampler},
                    fingerprint={"model": model_signature(model.state_dict()), "dataset_size": len(windows),
                                 "seed": args.seed},
                )
                loop = attempt.loop(sampler=sampler, checkpoints=checkpoints, max_steps=args.max_steps,  # elastic
                                    epochs=args.epochs, seed=args.seed, observer=observer, settings=settings,
                                    log_every=args.log_every, record_samples_dir=args.record_samples,
                                    lr=lambda: float(scheduler.get_last_lr()[0]))
                with loop:  # elastic: resumes here; on a failure, the last completed step is saved just in time
                    train_steps(args, loop, env, ddp, model, (optimizer, embedding_optimizer), scheduler, scaler,
                                windows, held_out)
        result = group.result
        if result is None:
            raise RuntimeError("the loop ended without a result")
    if env.is_rank0 and result.finished:
        log.info("final step %d loss %s checkpoint %s", result.step, result.loss, result.checkpoint)
    return result.exit_code  # not finished: stopped for a restart (exit 143, torchrun decides)


def train_steps(args: argparse.Namespace, loop: ElasticLoop, env: DistEnv, ddp: DDP, model: CharLM,
                optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
                scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler, windows: Windows,
                held_out: Windows) -> None:
    """The user's own steps, as a plain DDP loop writes them."""
    optimizer, embedding_optimizer = optimizers
    stream: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
    stream_at = (-1, -1)
    for plan in loop:  # elastic: this rank's share of each step, exactly once per epoch
        if args.stream:
            if stream is None or stream_at != (plan.epoch, plan.cursor):
                stream = Stream(windows, loop.sampler.order(plan.epoch)).from_position(plan.cursor)
            batch = [next(stream) for _ in range(plan.global_samples)]  # every rank reads the step
            stream_at = (plan.epoch, plan.next_cursor)
            mine = [batch[i - plan.cursor] for i in _positions(plan, env.rank, env.world_size)]
        else:
            mine = [windows[i] for i in plan.micro_batches[0].indices]
        tokens = torch.stack([x for x, _ in mine]).to(env.device)
        targets = torch.stack([y for _, y in mine]).to(env.device)
        mask = torch.ones_like(targets, dtype=torch.bool)
        mask[:, :4] = False  # score only positions with some context
        optimizer.zero_grad(set_to_none=True)
        embedding_optimizer.zero_grad(set_to_none=True)
        with torch.autocast(env.device.type, dtype=torch.float16, enabled=env.device.type == "cuda"):
            loss = masked_loss(ddp(tokens), targets, mask)
        # The global batch's mean whatever the world size: DDP averages over the ranks, each
        # rank weighs its share (a padding rank in a short last step weighs nothing).
        scaler.scale(loss * plan.samples * env.world_size / plan.global_samples).backward()
        scaler.unscale_(optimizer)
        scaler.unscale_(embedding_optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with loop.update(loss=loss):  # elastic: every change of the saved state, in here
            scaler.step(optimizer)
            scaler.step(embedding_optimizer)
            scaler.update()
            scheduler.step()
        TOKENS.inc(plan.samples * tokens.shape[1])
        if args.throttle_ms > 0:
            time.sleep(args.throttle_ms / 1000)
        if loop.step % args.eval_every == 0:  # between steps: evaluation is free to run
            evaluate(model, held_out, env, loop.step)


def _positions(plan: StepPlan, rank: int, world_size: int) -> list[int]:
    """The global positions of this rank's real samples in the step (as the sampler splits it)."""
    shares = split_evenly(plan.global_samples, world_size)
    start = plan.cursor + sum(shares[:rank])
    positions = list(range(start, start + shares[rank]))
    return positions or [plan.cursor]  # a padding rank: one sample, weight 0


@torch.no_grad()
def evaluate(model: nn.Module, held_out: Windows, env: object, step: int) -> None:
    model.eval()
    try:
        tokens = torch.stack([held_out[i][0] for i in range(64)]).to(next(model.parameters()).device)
        targets = torch.stack([held_out[i][1] for i in range(64)]).to(tokens.device)
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        if getattr(env, "is_rank0", False):
            log.info("eval at step %d: held-out loss %.4f", step, float(loss))
    finally:
        model.train()


if __name__ == "__main__":
    exit_process(main())
