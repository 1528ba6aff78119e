import math
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from model import GPT, GPTConfig, TokenWindows, evaluate  # your model, data and evaluation
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
torch.manual_seed(1337)
model = GPT(GPTConfig()).to(device)
ddp = DDP(model)
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
micro_batch, accumulation = 8, 4
sampler = DistributedSampler(dataset, shuffle=True, seed=1337)
loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)

step, epoch = 0, 0
while step < max_steps:
    sampler.set_epoch(epoch)
    batches = iter(loader)
    for _ in range(len(loader) // accumulation):
        for micro in range(accumulation):
            x, y = (t.to(device) for t in next(batches))
            with ddp.no_sync() if micro < accumulation - 1 else nullcontext():
                logits = ddp(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 250 == 0 and rank == 0:
            evaluate(model)
        if step == max_steps:
            break
    epoch += 1
dist.destroy_process_group()
