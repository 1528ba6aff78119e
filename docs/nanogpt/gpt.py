"""A small stand-in for nanoGPT's model.py and data/*/prepare.py, for train.py and its port."""

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 64
    n_embd: int = 32
    dropout: float = 0.1


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.block = nn.TransformerEncoderLayer(
            config.n_embd, 2, 4 * config.n_embd, dropout=config.dropout, batch_first=True
        )
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.size(1), device=idx.device)
        logits = self.lm_head(self.ln_f(self.block(self.wte(idx) + self.wpe(pos))))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def prepare(data_dir: str) -> str:
    """Writes train.bin and val.bin (uint16 tokens) once, as nanoGPT's prepare.py does."""
    os.makedirs(data_dir, exist_ok=True)
    for split, seed in (("train", 3), ("val", 4)):
        path = os.path.join(data_dir, f"{split}.bin")
        if not os.path.exists(path):
            g = torch.Generator().manual_seed(seed)
            tokens = torch.cumsum(torch.randint(-2, 3, (50_000,), generator=g), 0).remainder(64)
            tmp = f"{path}.{os.getpid()}"
            tokens.numpy().astype(np.uint16).tofile(tmp)
            os.replace(tmp, path)
    return data_dir
