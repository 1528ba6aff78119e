"""Your own training loop, elastic: a plain DDP loop, as the DDP guides write it, plus a few lines.

    elastic-trainer run --nproc-per-node 2 -m elastic_trainer.examples.own_loop --max-steps 200 \\
        --checkpoint-dir ./ckpt
    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=job-1 --nnodes=1:2 \\
        --nproc-per-node=2 --max-restarts=3 -m elastic_trainer.examples.own_loop --max-steps 200 \\
        --checkpoint-dir ./ckpt

A character-level language model (embedding, GRU, dropout) on a seeded synthetic text. The loop is
the user's: two optimizers (AdamW for the network, SGD for the embedding), gradient accumulation
(``--micro-batch-size``), a loss that needs an extra input (a mask of the positions to score),
gradient clipping, a GradScaler, a cosine schedule, evaluation every ``--eval-every`` steps and a
metric of its own. The lines marked ``# elastic`` are all it takes (``Elastic`` finds the
optimizers and the scheduler) to get exact resume of model, optimizers, scheduler, scaler, sampler
and random numbers, exactly-once data at any world size, periodic asynchronous checkpoints, the
SIGTERM checkpoint, the just-in-time save of the last step when a worker dies, progress lines and
metrics. Under ``elastic-trainer run`` a peer's failure is healed in place: the surviving
processes keep their model and optimizers and go on; only a process that died is started again,
and it takes its state from a live peer.

Streams (``--stream``): a checkpoint holds the epoch and the count of samples consumed (the
cursor), never the data. For an iterable dataset, exactly-once means: every position of an epoch
is trained once, provided the stream, re-created after a restart, yields the same samples in the
same order (a deterministic, replayable stream that can skip to the cursor); see :class:`Stream`.
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
from torch.utils.data import Dataset, IterableDataset

from elastic_trainer import Elastic, MicroBatch, Step  # elastic

PROG = "own_loop"
VOCAB = 32
log = logging.getLogger("elastic_trainer.examples.own_loop")

TOKENS = Counter(
    "own_loop_tokens_total", "Tokens this rank trained on (a metric of the user's own)"
)
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
        return self.text[start : start + self.context], self.text[
            start + 1 : start + self.context + 1
        ]


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
    losses = nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none"
    )
    weights = mask.reshape(-1).float()
    return (losses * weights).sum() / weights.sum().clamp(min=1.0)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m elastic_trainer.examples.{PROG}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many optimizer steps"
    )
    parser.add_argument("--epochs", type=int, default=3, help="passes over the dataset (default 3)")
    parser.add_argument(
        "--global-batch-size", type=int, default=32, help="samples per step over all ranks"
    )
    parser.add_argument(
        "--micro-batch-size", type=int, default=8, help="samples per forward (accumulation)"
    )
    parser.add_argument("--checkpoint-dir", default=None, help="directory every node shares")
    parser.add_argument(
        "--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the weights, the data order and every step"
    )
    parser.add_argument("--eval-every", type=int, default=50, help="evaluate every this many steps")
    parser.add_argument("--stream", action="store_true", help="read the data as an iterable stream")
    parser.add_argument(
        "--record-samples", metavar="DIR", default=None, help="audit: every step's indices"
    )
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--throttle-ms",
        type=float,
        default=0.0,
        help="sleep after every step: long enough to watch, kill or scale by hand (demos, tests)",
    )
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {os.environ.get('RANK', '0')}] "
        "%(levelname)s %(name)s: %(message)s",
    )
    device = torch.device(
        f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    )
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = CharLM(width=32, dropout=0.1).to(device)
    body = [p for name, p in model.named_parameters() if not name.startswith("embedding")]
    optimizer = torch.optim.AdamW(body, lr=3e-3, weight_decay=0.01)
    embedding_optimizer = torch.optim.SGD(model.embedding.parameters(), lr=0.1, momentum=0.9)
    windows = Windows(corpus(args.seed, 40_000), context=32)
    held_out = Windows(corpus(args.seed + 1, 4_000), context=32)
    per_epoch = -(-len(windows) // args.global_batch_size)
    total = (
        args.epochs * per_epoch
        if args.max_steps is None
        else min(args.max_steps, args.epochs * per_epoch)
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")
    elastic = Elastic(  # elastic: the group, DDP, resume, healing; it finds both optimizers and the scheduler
        model,
        len(windows) if args.stream else windows,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        max_steps=args.max_steps,
        epochs=args.epochs,
        seed=args.seed,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        scaler=scaler,
        log_every=args.log_every,
        record_samples_dir=args.record_samples,
        tokens_per_sample=32,
    )
    stream = StreamReader(windows, elastic) if args.stream else None
    for step in elastic:  # elastic: this rank's share of each step, exactly once per epoch
        with step:  # elastic: a peer's failure in here is healed in place, and the loop goes on
            for batch in step:  # elastic: the micro-batches (no_sync for all but the last)
                tokens, targets = stream.read(step, batch) if stream is not None else batch
                mask = torch.ones_like(targets, dtype=torch.bool)
                mask[:, :4] = False  # score only positions with some context
                with torch.autocast(
                    device.type, dtype=torch.float16, enabled=device.type == "cuda"
                ):
                    loss = masked_loss(
                        elastic.ddp(tokens), targets, mask
                    )  # elastic: the DDP of the moment
                step.backward(
                    loss * step.weight
                )  # elastic: the global batch's mean at any world size
                TOKENS.inc(tokens.shape[0] * tokens.shape[1])
            scaler.unscale_(optimizer)
            scaler.unscale_(embedding_optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.step(embedding_optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            embedding_optimizer.zero_grad(set_to_none=True)
        if args.throttle_ms > 0:
            time.sleep(args.throttle_ms / 1000)
        if step.completed and step.number % args.eval_every == 0:  # between steps: free to evaluate
            evaluate(model, held_out, step.number, is_rank0=elastic.env.is_rank0)
    result = elastic.result
    if result is not None and result.finished and elastic.env.is_rank0:
        log.info("final step %d loss %s checkpoint %s", result.step, result.loss, result.checkpoint)
    return (
        result.exit_code if result is not None else 1
    )  # elastic: not finished: exit 143, torchrun decides


class StreamReader:
    """Each step's samples from a :class:`Stream`: every rank reads the whole step and keeps its
    micro-batches; the stream is re-created at the step's cursor after a restart or a heal."""

    def __init__(self, windows: Windows, elastic: Elastic) -> None:
        self.windows, self.elastic = windows, elastic
        self._stream: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._next = (-1, -1)  # (epoch, cursor) the stream stands at
        self._at = (-1, -1)
        self._samples: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def read(self, step: Step, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        plan = step.plan
        if self._at != (plan.epoch, plan.cursor):
            order = self.elastic.sampler.order(plan.epoch)
            if self._stream is None or self._next != (plan.epoch, plan.cursor):
                self._stream = Stream(self.windows, order).from_position(plan.cursor)
            self._samples = {
                order[plan.cursor + k]: next(self._stream) for k in range(plan.global_samples)
            }
            self._at, self._next = (plan.epoch, plan.cursor), (plan.epoch, plan.next_cursor)
        device = self.elastic.device
        return (
            torch.stack([self._samples[i][0] for i in micro.indices]).to(device),
            torch.stack([self._samples[i][1] for i in micro.indices]).to(device),
        )


@torch.no_grad()
def evaluate(model: nn.Module, held_out: Windows, step: int, *, is_rank0: bool) -> None:
    model.eval()
    try:
        tokens = torch.stack([held_out[i][0] for i in range(64)]).to(
            next(model.parameters()).device
        )
        targets = torch.stack([held_out[i][1] for i in range(64)]).to(tokens.device)
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        if is_rank0:
            log.info("eval at step %d: held-out loss %.4f", step, float(loss))
    finally:
        model.train()


if __name__ == "__main__":
    sys.exit(main())
