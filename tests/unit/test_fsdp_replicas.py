"""``FSDPOptions(replicas=R)``: the Trainer's HSDP. ``shard_model`` shards over a ``(R, world // R)``
mesh (``replicate`` x ``shard``), which the sharded state reads back as R replicas; a count that
does not divide the world is one line. Two real gloo processes.

    pytest tests/unit/test_fsdp_replicas.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_trainer import FSDPOptions
from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.train.fsdp import shard_model
from tests.unit.test_fsdp_options import ROOT, Net

pytestmark = pytest.mark.timeout(120)


def test_replicas_that_do_not_divide_the_world_are_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        shard_model(Net(), FSDPOptions(replicas=3), torch.device("cpu"), 4)
    assert str(refused.value).startswith("fsdp.replicas: 3 replicas do not divide the 4 workers")
    with pytest.raises(ConfigError, match="fsdp.replicas"):
        FSDPOptions(replicas=0)


def _rank(store: str, rank: int, out: Path) -> None:
    import torch.distributed as dist

    from elastic_trainer.state.sharded import mesh_replicas

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    hsdp = shard_model(Net(), FSDPOptions(blocks=("blocks.*",), replicas=2), torch.device("cpu"), 2)
    fsdp = shard_model(Net(), FSDPOptions(blocks=("blocks.*",)), torch.device("cpu"), 2)
    mesh = next(hsdp.parameters()).device_mesh  # type: ignore[attr-defined]
    out.write_text(
        json.dumps(
            {
                "hsdp_replicas": mesh_replicas(hsdp),
                "fsdp_replicas": mesh_replicas(fsdp),
                "mesh": list(mesh.shape),
                "names": list(mesh.mesh_dim_names or ()),
            }
        )
    )
    dist.destroy_process_group()


def test_replicas_shard_over_a_replicate_by_shard_mesh(tmp_path: Path) -> None:
    store = tmp_path / "store"
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.unit.test_fsdp_replicas",
                str(store),
                str(rank),
                str(tmp_path / f"rank{rank}.json"),
            ],  # fmt: skip
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for run in runs:
        _, err = run.communicate(timeout=100)
        assert run.returncode == 0, err[-3000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {
            "hsdp_replicas": 2,
            "fsdp_replicas": 1,
            "mesh": [2, 1],
            "names": ["replicate", "shard"],
        }


if __name__ == "__main__":
    _rank(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
    os._exit(0)
