import math
import os

import torch
import torch.nn.functional as F
from model import GPT, GPTConfig, TokenWindows, evaluate  # your model, data and evaluation

from elastic_trainer import Elastic

device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
torch.manual_seed(1337)
model = GPT(GPTConfig()).to(device)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=6e-4, betas=(0.9, 0.95))
warmup, max_steps = 100, 2000


def lr_lambda(step: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (max_steps - warmup)))


scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
dataset = TokenWindows(block_size=64)
elastic = Elastic(model, dataset, global_batch_size=64, micro_batch_size=8, max_steps=max_steps, seed=1337,
                  checkpoint_dir="ckpt")

for step in elastic:
    with step:
        for x, y in step:
            logits = elastic.ddp(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            step.backward(loss * step.weight)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    if step.completed and step.number % 250 == 0 and elastic.env.is_rank0:
        evaluate(model)
raise SystemExit(elastic.result.exit_code)
