"""The neighbour copy of sharded state and its heal on NCCL (the paths a GPU job takes):

* the workers of ``tests/unit/test_neighbour_copy.py`` on GPUs: FSDP2 on CUDA with NCCL, each
  rank's shard staged into pinned host memory on a side stream and exchanged on the copy's gloo
  group; each rank holds its neighbour's shard byte for byte, and a staged shard put into a
  model sharded anew on the GPU replays a step bitwise;
* ``sharded_lm`` under ``elastic-trainer run`` on two GPUs: rank 1 SIGKILLed, the NCCL group is
  aborted and formed again in the survivor's process, rank 1's shard comes from rank 0's host
  copy, and the run ends bitwise equal to a fault-free one.

Marker ``gpu``: run with ``bash scripts/test.sh tests/gpu -m gpu``; skipped without CUDA (two GPUs
for the ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.chaos.test_sharded_heal import _check_exact, _start, _wait_between_steps
from tests.support.agents import agents, kill_rank, tails
from tests.unit.test_neighbour_copy import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _gpus(needed: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < needed:
        pytest.skip(f"needs {needed} CUDA devices (gpu marker)")


def test_neighbour_copy_on_nccl_stages_into_pinned_memory(tmp_path: Path) -> None:
    _gpus(2)
    run_ranks(tmp_path, "cuda", min(3, torch.cuda.device_count()))


def test_fsdp_heal_in_place_on_nccl(etcd_server, unique_id: str, tmp_path: Path) -> None:
    _gpus(2)
    reference, faulty = tmp_path / "reference", tmp_path / "faulty"
    with agents() as started:
        started.append(_start(etcd_server.endpoint, f"{unique_id}-ref", reference, 2))
        started[-1].wait(200)  # one job at a time: both use GPUs 0 and 1
        started.append(node := _start(etcd_server.endpoint, f"{unique_id}-faulty", faulty, 2))
        _wait_between_steps(faulty, 6, 2, started)
        kill_rank(node, faulty / "samples", 1)
        assert node.wait(200) == 0, tails(started)
    log = node.output()
    assert "rank 1's from rank 0's neighbour copy): 0 step(s) redone" in log, log[-4000:]
    _check_exact(reference, faulty)
