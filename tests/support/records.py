"""What a run left behind, read as a user would: the runtime's sample records, checkpoints and
the final line of rank 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from elastic_trainer.runtime.sample_log import read_records
from tests.support.agents import Agent


def world_of(records: list[dict[str, Any]]) -> int:
    """The world size of one process's records (from its ``start`` record)."""
    return int(records[0]["world_size"])


def steps_recorded(directory: Path, *, world_size: int | None = None) -> int:
    """The highest step any rank completed (optionally only in a world of ``world_size``)."""
    best = 0
    if not directory.exists():
        return 0
    for records in read_records(directory):
        for record in records:
            if record["event"] == "done" and (
                world_size is None or world_of(records) == world_size
            ):
                best = max(best, record["step"])
    return best


def final_model(checkpoint_dir: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """Step and model state of the newest checkpoint."""
    newest = sorted(checkpoint_dir.glob("ckpt-*.pt"))[-1]
    state = torch.load(newest, weights_only=True)
    return state["step"], state["model"]


def final_sharded_state(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The newest sharded checkpoint, gathered: step, model and optimizer state as one flat dict
    of tensors (``model.<name>``, ``optimizer.<param>.<entry>``), for bitwise comparisons."""
    from elastic_trainer.checkpoint import files as ckpt
    from elastic_trainer.checkpoint import sharded

    info = ckpt.find_latest(checkpoint_dir)
    assert info is not None and info.manifest.sharded
    state = sharded.read_full(info.path)
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for key, entry in state["optimizer"]["state"].items():
        flat.update({f"optimizer.{key}.{name}": value for name, value in entry.items()})
    return {"step": torch.tensor(state["step"]), **flat}


def final_eval_loss(agent: Agent) -> float:
    """The full-dataset loss on rank 0's ``final step ...`` line."""
    for line in reversed(agent.output().splitlines()):
        if line.startswith("final step") and "eval_loss None" not in line:
            return float(line.split(" eval_loss ")[1].split()[0])
    raise AssertionError(f"no final line in the log of agent {agent.pid}:\n{agent.tail()}")
