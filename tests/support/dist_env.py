"""A worker's place in the job for tests that run without torchrun: CPU, gloo."""

from __future__ import annotations

import torch

from elastic_trainer.runtime.distributed import DistEnv


def cpu_env(rank: int = 0, world_size: int = 1, *, launched: bool = False) -> DistEnv:
    """Rank ``rank`` of ``world_size`` on one host, CPU and gloo, as ``read_env`` would give it."""
    return DistEnv(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        restart_count=0,
        launched=launched,
        device=torch.device("cpu"),
        backend="gloo",
    )
