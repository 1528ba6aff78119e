"""A gloo worker for test_heal_group: rank 2 freezes (SIGSTOP) at iteration 5; rank 0 and 1 abort
their group from another thread 1 s later (HealableGroup.abort), expect the blocked allreduce to
fail at once, and form a two-rank group on a new store prefix.

    python heal_group_worker.py RANK STORE_FILE OUT_FILE
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from elastic_trainer.heal.group import HealableGroup


def main() -> None:
    rank, store_file, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    store = dist.FileStore(store_file, 3)
    group = HealableGroup("gloo", timeout_s=600.0)
    group.create(rank=rank, world_size=3, store=dist.PrefixStore("epoch-1", store))
    tensor = torch.ones(4)
    blocked_for = None
    for i in range(10_000):
        if rank == 2 and i == 5:
            os.kill(os.getpid(), signal.SIGSTOP)
        if rank != 2 and i == 5:
            threading.Timer(1.0, group.abort).start()
        started = time.monotonic()
        try:
            dist.all_reduce(tensor)
        except RuntimeError:
            blocked_for = time.monotonic() - started
            break
    group.destroy()
    two = dist.PrefixStore("epoch-2", dist.FileStore(store_file + ".2", 2))
    group.create(rank=rank, world_size=2, store=two)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    group.destroy()
    with open(out, "w") as file:
        json.dump({"blocked_for": blocked_for, "sum": float(value[0])}, file)


if __name__ == "__main__":
    main()
