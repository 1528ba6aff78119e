"""A small transformer language model sharded with FSDP2 (``fully_shard``), elastic and exact.

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=lm-1 --nnodes=1:2 \\
        --nproc-per-node=2 --max-restarts=3 -m elastic_trainer.examples.sharded_lm --max-steps 200 \\
        --checkpoint-dir ./ckpt
    elastic-trainer run --nproc-per-node 2 -m elastic_trainer.examples.sharded_lm --max-steps 200 \\
        --checkpoint-dir ./ckpt
    elastic-trainer checkpoint export ./ckpt model.pt    # one plain file of the full model
    ... -m elastic_trainer.examples.sharded_lm --api trainer --max-steps 200 --checkpoint-dir ./ckpt

Every transformer block and the whole model are sharded with ``fully_shard`` over all ranks
(``--replicas 2``: HSDP over a replicate x shard mesh); each rank holds, saves and loads only its
own shards (the state owner sees the DTensors; the one ``CheckpointManager`` writes sharded DCP
checkpoints, asynchronously by default). A restart, at the same or another world size, resumes
from the newest checkpoint resharded onto the new world: the model, AdamW's state, the sampler's
cursor and the step. Every step's random numbers (dropout) are a function of ``(seed, rank,
step)``, so a run restarted after a fault ends bitwise equal to one without the fault that went
through the same world sizes, and every sample of an epoch is trained exactly once
(``--record-samples`` writes the audit log). Under plain torchrun a worker SIGKILL costs at most
one step: the survivors write every shard they hold, the dead rank's from its neighbour's host
copy, as a just-in-time checkpoint of the last completed step; a SIGTERM stops every rank after
the same step, with a final checkpoint. Under ``elastic-trainer run`` a worker fault heals in
place: the survivors keep their processes, the model is built and sharded again on the healed
group, and the lost rank's shard comes from its neighbour's host copy (``--shard-copy-every``,
default every step; with HSDP from its replica); when no copy survived, every rank resumes from
the newest checkpoint, resharded. A node lost for good or joining (``--nnodes 1:N``) changes the
world size: the shards in memory are resharded onto it in place.

``--api loop`` (the default) is a loop of your own on ``Elastic`` (``with ElasticGroup() as
group:``, ``Elastic(..., group=group, rebuild=build)``: ``docs/own-loop.md``, "A model you shard
yourself"); ``--api trainer`` trains the same model with the runtime's ``Trainer`` and
``TrainerConfig(fsdp=FSDPOptions(...))`` (``--fsdp-blocks``, ``--fsdp-mixed-precision``,
``--no-reshard-after-forward``; ``--replicas`` is ``FSDPOptions(replicas=...)``, HSDP). Both
import only from the package root.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import Dataset

from elastic_trainer import (
    CheckpointConfig,
    Elastic,
    ElasticGroup,
    FSDPOptions,
    NeighbourCopyConfig,
    RunConfig,
    Trainer,
    TrainerConfig,
    TrainingJob,
    apply_fsdp,
    exit_process,
)

PROG = "sharded_lm"
VOCAB, CONTEXT = 32, 16
log = logging.getLogger("elastic_trainer.examples.sharded_lm")


def corpus(seed: int, length: int) -> torch.Tensor:
    """A seeded synthetic text with structure to learn: a random walk over the alphabet."""
    generator = torch.Generator().manual_seed(seed + 7)
    return torch.cumsum(torch.randint(-2, 3, (length,), generator=generator), 0).remainder(VOCAB)


class TinyTransformer(nn.Module):
    """Embedding, pre-norm causal transformer blocks with dropout, and a head."""

    def __init__(
        self, width: int = 32, depth: int = 2, heads: int = 4, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(CONTEXT, width))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width,
                heads,
                dim_feedforward=2 * width,
                dropout=dropout,
                batch_first=True,
                norm_first=True,
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(x))


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i``: the ``i``-th window of the text (inputs) and the same shifted by one (targets)."""

    def __init__(self, text: torch.Tensor) -> None:
        self.text = text

    def __len__(self) -> int:
        return (len(self.text) - 1) // CONTEXT

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.text[i * CONTEXT : i * CONTEXT + CONTEXT + 1]
        return window[:-1], window[1:]


def shard(
    model: TinyTransformer,
    world_size: int,
    device_type: str,
    replicas: int = 1,
    options: FSDPOptions | None = None,
) -> None:
    """FSDP2: each block is one unit (its parameters gathered for its forward only), then the rest
    (``fully_shard`` on ``blocks.0``, ``blocks.1``, ..., then on the model). ``replicas`` > 1:
    HSDP over a ``(replicas, world_size // replicas)`` mesh."""
    mesh = (
        init_device_mesh(device_type, (world_size,))
        if replicas == 1
        else init_device_mesh(
            device_type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard")
        )
    )
    apply_fsdp(model, options or FSDPOptions(blocks=("blocks.*",)), mesh)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    _run_options(parser)
    _trainer_options(parser)
    args = parser.parse_args(argv)
    for name in (
        "epochs",
        "global_batch_size",
        "dataset_size",
        "checkpoint_every",
        "keep_last",
        "log_every",
        "replicas",
    ):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}: must be positive")
    if args.max_steps is not None and args.max_steps <= 0:
        parser.error("--max-steps: must be positive")
    return args


def _run_options(parser: argparse.ArgumentParser) -> None:
    """What the run is, whichever API trains it (:func:`run_config`)."""
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many optimizer steps"
    )
    parser.add_argument("--epochs", type=int, default=3, help="passes over the dataset (default 3)")
    parser.add_argument(
        "--global-batch-size", type=int, default=24, help="samples per step over all ranks"
    )
    parser.add_argument(
        "--dataset-size", type=int, default=2400, help="windows of the synthetic text"
    )
    parser.add_argument("--checkpoint-dir", default=None, help="directory every node shares")
    parser.add_argument(
        "--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)"
    )
    parser.add_argument("--keep-last", type=int, default=3, help="checkpoints kept (default 3)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the weights, the data order and every step"
    )
    parser.add_argument(
        "--record-samples", metavar="DIR", default=None, help="audit: every step's indices"
    )
    parser.add_argument(
        "--shard-copy-every",
        type=int,
        default=None,
        help="steps between refreshes of each shard's copy on its neighbour (default 1; 0: off)",
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="HSDP: replicas of each shard (default 1: FSDP)"
    )
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--throttle-ms", type=float, default=0.0, help="sleep per step (to watch or inject faults)"
    )


def _trainer_options(parser: argparse.ArgumentParser) -> None:
    """Which API trains the model, and the ``Trainer``'s FSDP2 options."""
    parser.add_argument(
        "--api",
        choices=("loop", "trainer"),
        default="loop",
        help="loop: the hand-written loop; trainer: the runtime's Trainer with TrainerConfig.fsdp",
    )
    parser.add_argument(
        "--fsdp-blocks",
        default="blocks.*",
        help="(--api trainer) comma-separated module names sharded as units (default blocks.*)",
    )
    parser.add_argument(
        "--fsdp-mixed-precision",
        choices=("no", "bf16", "fp16"),
        default="no",
        help="(--api trainer) FSDP2 compute dtype of the parameters (reduction stays float32)",
    )
    parser.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="(--api trainer) free each unit's gathered parameters after its forward",
    )


def run_config(args: argparse.Namespace) -> RunConfig:
    """The run's settings, for ``Elastic`` and (extended) ``TrainerConfig`` alike."""
    return RunConfig(
        global_batch_size=args.global_batch_size,
        seed=args.seed,  # the data order, the weights' seed and every step's dropout
        epochs=args.epochs,
        max_steps=args.max_steps,
        checkpoint=CheckpointConfig(
            directory=args.checkpoint_dir, every=args.checkpoint_every, keep_last=args.keep_last
        ),
        shard_copy=(
            NeighbourCopyConfig(every=args.shard_copy_every)
            if args.shard_copy_every is not None
            else None
        ),
        log_every=args.log_every,
        record_samples_dir=args.record_samples,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Train; the exit code. A mistake left uncaught is one line and exit status 2 (``Elastic``
    installs the hook that says it; the ``Trainer`` returns it)."""
    return train(parse_args(sys.argv[1:] if argv is None else argv))


def dataset(args: argparse.Namespace) -> Windows:
    return Windows(corpus(args.seed, args.dataset_size * CONTEXT + 1))


def optimizer_for(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.transpose(1, 2), targets)


def sharded_model(
    world_size: int, device: torch.device, replicas: int, options: FSDPOptions | None = None
) -> TinyTransformer:
    """``TinyTransformer`` on ``device``, sharded over the current group (HSDP over a
    ``(replicas, world_size // replicas)`` mesh when ``replicas`` > 1)."""
    if world_size % replicas:
        raise ValueError(f"--replicas {replicas} does not divide {world_size} workers")
    model = TinyTransformer().to(device)
    shard(model, world_size, device.type, replicas, options)
    return model


def build(env: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The model sharded over the current group (HSDP with ``--replicas`` > 1) and its optimizer,
    by the names they are saved under: built again after each heal (``Elastic(rebuild=...)``)."""
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = sharded_model(env.world_size, env.device, args.replicas)
    return {"model": model, "optimizer": optimizer_for(model.parameters())}


def train(args: argparse.Namespace) -> int:
    # torch warns, once per rank, that the root FSDP2 module returns a view (the head's output):
    # only an in-place op on it would skip a hook, and the loss reads it out of place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    if args.api == "trainer":
        return finished(train_with_trainer(args))
    pause = args.throttle_ms / 1000
    with ElasticGroup(pg_timeout_s=60) as group:  # forms the process group, and heals it in place
        with group.groups():  # the mesh's subgroups (HSDP) are aborted with the group at a heal
            first = build(group.env, args)
        elastic = Elastic(
            first["model"],
            dataset(args),
            config=run_config(args),
            states={"optimizer": first["optimizer"]},
            find=False,
            tokens_per_sample=CONTEXT,
            after_step=[lambda step: time.sleep(pause)] if pause else (),
            rebuild=lambda env: build(env, args),
            group=group,
        )
        for step in elastic:
            model, optimizer = (
                elastic.module,
                elastic.state.objects["optimizer"],
            )  # rebuilt at a heal
            with step:
                for inputs, targets in step:
                    step.backward(lm_loss(model(inputs), targets) * step.weight)
                optimizer.step()  # type: ignore[union-attr]
                optimizer.zero_grad(set_to_none=True)  # type: ignore[union-attr]
    return 0 if elastic.result is None else finished(elastic.result)


def finished(result: Any) -> int:
    """Rank 0 names the final checkpoint; the exit code of the run's end."""
    if result.finished and int(os.environ.get("RANK", "0")) == 0:
        log.info("final step %d checkpoint %s", result.step, result.checkpoint)
    return int(result.exit_code)


def train_with_trainer(args: argparse.Namespace) -> Any:
    """The same model, data and optimizer through ``Trainer`` with ``TrainerConfig.fsdp``; its
    result."""
    fsdp = FSDPOptions(
        blocks=tuple(b.strip() for b in args.fsdp_blocks.split(",") if b.strip()),
        mixed_precision=args.fsdp_mixed_precision,
        reshard_after_forward=args.reshard_after_forward,
        replicas=args.replicas,  # > 1: HSDP over a (replicas, world // replicas) mesh
    )
    run = run_config(args)
    config = TrainerConfig(
        **{f.name: getattr(run, f.name) for f in dataclasses.fields(run)}, fsdp=fsdp
    )
    job = TrainingJob(
        model=TinyTransformer,
        dataset=lambda: dataset(args),
        optimizer=optimizer_for,
        loss=lm_loss,
        tokens_per_sample=CONTEXT,
    )
    pause = args.throttle_ms / 1000
    return Trainer(
        config, job, callbacks=[lambda trainer, step: time.sleep(pause)] if pause else ()
    ).fit()


if __name__ == "__main__":
    exit_process(main())
