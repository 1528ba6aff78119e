"""Benchmark workloads: the runtime's example CNN (CPU-sized) and a GPT-2-small-shaped decoder
language model, the "real model" of the GPU measurements.

``cnn`` is ``elastic_trainer.examples.synthetic_cnn``'s SmallCNN on its synthetic images: a step of
a few ms on CPU, so fixed per-step costs show. ``gpt`` is a pre-norm causal decoder with GPT-2
small's shape by default (12 layers, d_model 768, 12 heads, 50304-token vocabulary, tied
embeddings, ~124M parameters; attention through ``scaled_dot_product_attention``, i.e. flash
attention on a recent GPU) on random token sequences: 13 DDP buckets (a first one of 9 MB, eleven
of 27 MB, and the 168 MB tied embedding), so a per-bucket cost in a communication hook shows 13
times a step. ``mlp`` is a 4-layer MLP on random vectors (``Linear(1024, w)``, two ``Linear(w, w)``,
``Linear(w, 10)``): one 12.6 MB gradient bucket at width 1024, two (42 MB) at 2048, so a cost per
gradient byte shows (issue 30). The data are random, so the loss says nothing; the cost of a step
is what is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, default_collate

from elastic_trainer.examples.synthetic_cnn import SmallCNN, SyntheticImages

MODELS = ("cnn", "gpt", "mlp")
MLP_INPUTS = 1024


def mlp(width: int) -> nn.Module:
    """The ``mlp`` workload's model (see the module docstring)."""
    return nn.Sequential(
        nn.Linear(MLP_INPUTS, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 10),
    )


class RandomVectors(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``size`` random ``MLP_INPUTS``-vectors with one of 10 labels each."""

    def __init__(self, size: int, *, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, MLP_INPUTS, generator=generator)
        self.labels = torch.randint(10, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=2)
        q, k, v = (
            t.view(batch, seq, self.heads, d_model // self.heads).transpose(1, 2) for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class DecoderBlock(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class DecoderLM(nn.Module):
    """A GPT-2-shaped decoder-only language model (token + position embeddings, pre-norm blocks,
    final LayerNorm, output projection tied to the token embedding)."""

    def __init__(self, *, vocab: int = 50304, seq_len: int = 1024, d_model: int = 768, layers: int = 12,
                 heads: int = 12) -> None:  # fmt: skip
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(DecoderBlock(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tokens.weight
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                std = (
                    0.02 / math.sqrt(2 * layers)
                    if name.endswith(("proj.weight", "mlp.2.weight"))
                    else 0.02
                )
                nn.init.normal_(param, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class RandomTokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``size`` sequences of ``seq_len + 1`` random tokens; item = (inputs, next-token targets)."""

    def __init__(self, size: int, *, seq_len: int, vocab: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(vocab, (size, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.data[index]
        return row[:-1], row[1:]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


@dataclass(frozen=True, slots=True)
class Workload:
    """Factories for one benchmark job: the model, its dataset and its loss."""

    name: str
    model: Callable[[], nn.Module]
    dataset: Callable[[], Dataset[Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    tokens_per_sample: int


def workload(name: str, *, width: int = 32, seq_len: int = 1024, layers: int = 12, dataset_size: int = 4096,
             seed: int = 0, d_model: int = 768, vocab: int = 50304) -> Workload:  # fmt: skip
    """The named workload (``cnn``: the example's SmallCNN of ``width``; ``gpt``: the decoder with
    ``layers`` blocks of ``d_model`` (a head per 64) on ``seq_len``-token sequences of a
    ``vocab``-token vocabulary; GPT-2 small's by default, smaller for wiring checks such as
    ``gpu_check --dry-run``; ``mlp``: the MLP of ``width``)."""
    if name == "mlp":
        return Workload(name, lambda: mlp(width), lambda: RandomVectors(dataset_size, seed=seed),
                        nn.CrossEntropyLoss(), 0)  # fmt: skip
    if name == "cnn":
        return Workload(name, lambda: SmallCNN(width), lambda: SyntheticImages(dataset_size, seed=seed),
                        nn.CrossEntropyLoss(), 0)  # fmt: skip
    if name == "gpt":
        return Workload(name, lambda: DecoderLM(vocab=vocab, seq_len=seq_len, d_model=d_model, layers=layers,
                                                heads=max(1, d_model // 64)),
                        lambda: RandomTokens(dataset_size, seq_len=seq_len, vocab=vocab, seed=seed),
                        lm_loss, seq_len)  # fmt: skip
    raise ValueError(f"workload: expected one of {MODELS}, got {name!r}")


def workload_of(args: argparse.Namespace) -> Workload:
    """The workload that :func:`add_workload_arguments`' options name."""
    return workload(args.model, width=args.width, seq_len=args.seq_len, layers=args.layers,
                    dataset_size=args.dataset_size, seed=args.seed, d_model=args.d_model,
                    vocab=args.vocab)  # fmt: skip


def rank_batches(job: Workload, args: argparse.Namespace, rank: int, world: int,
                 device: torch.device) -> list[tuple[torch.Tensor, ...]]:  # fmt: skip
    """This rank's share (``--global-batch-size`` / ``world`` samples) of each global batch of the
    job's dataset, collated onto ``device`` once, so that steps never wait for data."""
    data = job.dataset()
    per_rank = args.global_batch_size // world
    return [
        tuple(t.to(device) for t in default_collate([data[j] for j in range(i, i + per_rank)]))
        for i in range(rank * per_rank, len(data) - per_rank, world * per_rank)  # type: ignore[arg-type]
    ]


def autocast_of(args: argparse.Namespace) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The forward's context: bf16 autocast for the GPU model (``args.bf16``), else nothing."""
    if args.bf16:
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def train_step(job: Workload, ddp: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               target: torch.Tensor, autocast: Callable[[], contextlib.AbstractContextManager[Any]]) -> float:  # fmt: skip
    """One plain training step (forward under ``autocast``, backward, update); returns the loss.

    Reading the loss synchronises with the GPU, as the runtime does every step: the step's wall
    time is then its cost."""
    with autocast():
        loss = job.loss(ddp(inputs), target)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.item())


def init_worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """Environment, device and process group of one benchmark rank (gloo on CPU, NCCL on CUDA)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world
    )


def add_workload_arguments(
    parser: argparse.ArgumentParser, *, width: int = 16, cnn_batch: int = 64
) -> None:
    """The workload options every benchmark here takes (see :func:`resolve_workload_arguments`)."""
    parser.set_defaults(cnn_batch=cnn_batch)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo processes (2 unless --nproc); cuda: one NCCL process per GPU (default cpu)",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="cnn",
        help="cnn: the example's SmallCNN; gpt: a GPT-2-small-shaped decoder; mlp: the 4-layer MLP (workloads.py)",
    )
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help=f"samples per step over all ranks (default: {cnn_batch} for cnn, 8 per rank for gpt)",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=width,
        help="cnn: channels of the first conv layer; mlp: hidden width",
    )
    parser.add_argument("--seq-len", type=int, default=1024, help="gpt: tokens per sequence")
    parser.add_argument("--layers", type=int, default=12, help="gpt: decoder blocks")
    parser.add_argument(
        "--d-model", type=int, default=768, help="gpt: width, a head per 64 (768: GPT-2 small)"
    )
    parser.add_argument(
        "--vocab", type=int, default=50304, help="gpt: vocabulary (50304: GPT-2's, padded)"
    )
    parser.add_argument("--dataset-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)


def cuda_processes(requested: int | None) -> int:
    """Processes of a CUDA run: ``requested``, else one per visible GPU.

    Raises:
        ValueError: no CUDA device is visible, or fewer than ``requested`` (one line).
    """
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise ValueError("--device cuda: no CUDA device is visible")
    nproc = requested or visible
    if nproc > visible:
        raise ValueError(f"--nproc {nproc}: NCCL needs one GPU per process, {visible} visible")
    return nproc


def uses_bf16(device: str, model: str) -> bool:
    """Whether the forward runs under bf16 autocast: the decoder on CUDA, as every GPU figure."""
    return device == "cuda" and model == "gpt"


def resolve_workload_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Processes (``--nproc`` where a benchmark has it, else 2 on CPU and one per GPU on CUDA), the
    default batch, and bf16 for the GPU model."""
    requested = getattr(args, "nproc", None)
    if args.device == "cuda":
        try:
            args.nproc = cuda_processes(requested)
        except ValueError as exc:
            parser.error(str(exc))
    else:
        args.nproc = requested or 2
    if args.global_batch_size is None:
        args.global_batch_size = args.cnn_batch if args.model == "cnn" else 8 * args.nproc
    if args.global_batch_size < args.nproc:
        parser.error(
            f"--global-batch-size {args.global_batch_size}: fewer samples than the {args.nproc} processes"
        )
    args.bf16 = uses_bf16(args.device, args.model)
