"""Peer state transfer over a real two-rank gloo group: every rank gets the source's payload back
exactly (every dtype, shape and container; tensors independent of the source's own)."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_trainer.heal.state_transfer import share_state
from elastic_trainer.runtime.process_exit import exit_process

pytestmark = pytest.mark.timeout(120)


def payload() -> dict:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(7, 5, generator=generator)
    return {
        "format": 2,
        "step": 41,
        "epoch": 1,
        "world_size": 2,
        "model": OrderedDict(
            **{
                "conv.weight": weight,
                "bn.num_batches_tracked": torch.tensor(41),
                "half": torch.randn(3, 3, generator=generator).to(torch.bfloat16),
                "transposed": weight.t(),
                "empty": torch.empty(0, 4),
            }
        ),
        "optimizer": {
            "state": {
                0: {"step": torch.tensor(41.0), "exp_avg": torch.randn(7, 5, generator=generator)}
            },
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
        },
        "sampler": {"epoch": 1, "cursor": 96, "order": None},
        "rng": {
            "torch": torch.Generator().manual_seed(5).get_state(),
            "flags": torch.tensor([True, False, True]),
        },
        "config": {"name": "job", "values": [1, 2.5, "x", None]},
    }


def payload_with_metadata() -> dict:
    value = payload()
    value["model"]._metadata = OrderedDict({"": {"version": 1}, "bn": {"version": 2}})
    return value


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def _rank(rank: int, store_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_file, 2), rank=rank, world_size=2)
    try:
        source = payload_with_metadata()
        got = share_state(source if rank == 1 else None, src=1, device=torch.device("cpu"))
        expected = payload()
        assert same(expected, expected) and not same(expected, {**expected, "step": 40})
        result = {
            "differ": [k for k in expected if not same(expected[k], got[k])],
            "independent": True,
            "ordered": type(got["model"]) is OrderedDict
            and list(got["model"]) == list(expected["model"]),
            "metadata": getattr(got["model"], "_metadata", None)
            == {"": {"version": 1}, "bn": {"version": 2}},
            "own_storage": got["model"]["conv.weight"].untyped_storage().nbytes() == 7 * 5 * 4,
            "step": got["step"],
            "betas": list(got["optimizer"]["param_groups"][0]["betas"]),
        }
        if rank == 1:
            got["model"]["conv.weight"].zero_()  # the copy, not the source's own tensor
            result["independent"] = same(
                source["model"]["conv.weight"], expected["model"]["conv.weight"]
            )
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_process(0)  # torch 2.13's gloo can abort in interpreter teardown (runtime/process_exit.py)


def test_every_rank_gets_the_payload_back_exactly(tmp_path: Path) -> None:
    mp.start_processes(
        _rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    for rank in range(2):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result == {
            "differ": [],
            "independent": True,
            "ordered": True,
            "metadata": True,
            "own_storage": True,
            "step": 41,
            "betas": [0.9, 0.999],
        }, (rank, result)
