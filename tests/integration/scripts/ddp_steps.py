"""A tiny DDP job for rendezvous tests: N steps of a linear model, gloo on CPU.

Environment knobs (tests set them):
  STEPS            number of steps (default 20)
  STEP_SLEEP_S     sleep per step, to leave room for faults (default 0.05)
  OUT_DIR          where rank 0 writes ``done-<attempt>.json`` with world size and the weights sum,
                   and each node's workers ``progress-<group rank>`` ("STEP WORLD_SIZE" after each step)
  DIE_AT_STEP      on the first attempt, the rank given by DIE_RANK SIGKILLs itself at this step
  STOP_FILE        once this file exists, every rank stops after the same step (agreed by an allreduce)
"""

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    steps = int(os.environ.get("STEPS", "20"))
    sleep_s = float(os.environ.get("STEP_SLEEP_S", "0.05"))
    die_at = int(os.environ.get("DIE_AT_STEP", "-1"))
    die_rank = int(os.environ.get("DIE_RANK", "1"))
    stop_file = os.environ.get("STOP_FILE")
    out = Path(os.environ["OUT_DIR"])
    with open(out / "starts", "a") as starts:  # one line per worker start, restarts included
        starts.write(f"{os.getpid()}\n")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        if attempt == 0 and step == die_at and rank == die_rank and not (out / "died").exists():
            (out / "died").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.full((4, 8), float(rank + 1))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        (out / f"progress-{os.environ.get('GROUP_RANK', '0')}").write_text(f"{step} {world}")
        time.sleep(sleep_s)
        if stop_file is not None:
            stop = torch.tensor([float(Path(stop_file).exists())])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    if rank == 0:
        result = {
            "world_size": world,
            "rank_sum": total.item(),
            "attempt": attempt,
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "rdzv_backend_env": os.environ.get("ELASTIC_TRAINER_RDZV_BACKEND"),
        }
        (out / f"done-{os.environ.get('TORCHELASTIC_RUN_ID')}-{attempt}.json").write_text(
            json.dumps(result)
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown. After a clean destroy_process_group, torch/gloo's C++
    # teardown occasionally aborts ("terminate called without an active exception", SIGABRT):
    # the agent then counts this finished worker as failed and restarts the whole group once
    # more -- an extra rendezvous round after the job had already finished. Every file this
    # script writes is closed by now.
    from elastic_trainer.runtime.process_exit import exit_process

    exit_process(0)
