"""The baseline of ``benchmarks/recovery.py``: plain DDP as the guides write it, under plain torchrun.

    torchrun --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=base --nnodes=1:2 \\
        --nproc-per-node=2 --max-restarts=10 benchmarks/baseline_ddp_checkpoint.py \\
        --checkpoint /tmp/base/model.checkpoint --record-steps /tmp/base/steps --max-steps 400

The same model, data and optimizer as ``elastic_trainer.examples.synthetic_cnn`` (imported from
it), trained the way ``shared/reference/ddp-step-by-step.txt`` and ``ddp-notebook.txt`` show:
``init_process_group`` from torchrun's environment, ``DistributedSampler``, and the hand-written
rank-0 checkpoint -- ``{'iter_no', 'model', 'optimizer'}`` saved by rank 0 every
``--checkpoint-every`` iterations to one path, a ``dist.barrier()`` after it, and on start the
checkpoint loaded with a ``map_location`` to resume at ``iter_no + 1`` (the sampler's epoch
fast-forwarded to that iteration). Nothing else: no SIGTERM handling, no atomic write, no
elastic batch split (each rank takes ``global_batch_size // world_size`` samples).

Every completed step is appended, with its wall time, to ``--record-steps`` in the JSON-lines
format of ``elastic_trainer.runtime.sample_log`` (a ``start`` record, then one record per step), which
is what the benchmark reads for both systems. Loading uses ``weights_only=True`` (torch's
default since 2.6) like every checkpoint load in this project.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from elastic_trainer.examples.synthetic_cnn import SmallCNN, SyntheticImages


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="the one checkpoint file rank 0 writes")
    parser.add_argument(
        "--record-steps", required=True, help="directory for the per-step JSON lines"
    )
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--dataset-size", type=int, default=2048)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--throttle-ms", type=float, default=0.0, help="sleep after every step")
    return parser.parse_args(argv)


class StepRecords:
    """Per-process JSON lines, as ``elastic_trainer.runtime.sample_log`` writes them (plus ``t``)."""

    def __init__(self, directory: str, rank: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        path = Path(directory) / f"samples-rank{rank:04d}-pid{os.getpid()}.jsonl"
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - process lifetime

    def write(self, **record: object) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DDP(SmallCNN(args.width))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    dataset = SyntheticImages(args.dataset_size, seed=args.seed)
    sampler: DistributedSampler[tuple[torch.Tensor, torch.Tensor]] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(
        dataset, batch_size=max(1, args.global_batch_size // world), sampler=sampler, drop_last=True
    )

    # -- the guides' load: resume at iter_no + 1 ---------------------------------------------------
    start_iter = 0
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, map_location={"cuda:0": "cpu"}, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_iter = state["iter_no"] + 1

    generation = [uuid.uuid4().hex]
    dist.broadcast_object_list(generation, src=0)
    records = StepRecords(args.record_steps, rank)
    records.write(
        event="start",
        generation=generation[0],
        started_unix=time.time(),
        resumed_step=start_iter,
        world_size=world,
        rank=rank,
    )
    steps_per_epoch = len(loader)
    iter_no = start_iter
    while iter_no < args.max_steps:
        epoch, skip = divmod(iter_no, steps_per_epoch)
        sampler.set_epoch(epoch)
        for index, (images, labels) in enumerate(loader):
            if index < skip:
                continue  # fast-forward to where the checkpoint left off
            optimizer.zero_grad()
            loss_fn(model(images), labels).backward()
            optimizer.step()
            records.write(
                event="step", step=iter_no + 1, world_size=world, rank=rank, t=time.time()
            )
            # -- the guides' save: rank 0, in place, then a barrier ------------------------------
            if (iter_no + 1) % args.checkpoint_every == 0:
                if rank == 0:
                    torch.save(
                        {
                            "iter_no": iter_no,
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                        },
                        args.checkpoint,
                    )
                dist.barrier()
            iter_no += 1
            if args.throttle_ms:
                time.sleep(args.throttle_ms / 1000)
            if iter_no >= args.max_steps:
                break
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
