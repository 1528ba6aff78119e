"""Resharding local shards in memory (``state/reshard.py``, pure): for N -> M world sizes, sizes
not divisible, and shards with zero rows, the new pieces are exactly ``torch.chunk`` of the full
tensor (what FSDP2 holds at M ranks), model entries and AdamW state alike, and every rank keeps
only the rows of its own new chunk."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastic_trainer.state import flat
from elastic_trainer.state.local_shards import DIM0, FORMAT, LAYOUT, SHARD
from elastic_trainer.state.reshard import Resharder, chunk_rows, pieces, unsupported

SHAPES = {"embedding.weight": (7, 3), "head.bias": (2,), "head.weight": (5, 4), "norm": (1, 2)}


def _chunk(full: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """What FSDP2 holds at ``parts`` ranks: torch.chunk, empty (other dims kept) beyond it."""
    chunks = torch.chunk(full, parts)
    return chunks[index] if index < len(chunks) else full[0:0]


def _full_state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator, dtype=torch.float64)
        for name, shape in SHAPES.items()
    }


def _payload(full: dict[str, torch.Tensor], world: int, rank: int) -> dict[str, Any]:
    """What ``local_state`` gives on rank ``rank`` of ``world``: a model and one AdamW."""
    names = list(full)
    return {
        "format": FORMAT,
        "step": 12,
        "model": {name: {SHARD: _chunk(t, world, rank)} for name, t in full.items()},
        "optimizers": [
            {
                "state": {
                    i: {
                        "step": torch.tensor(12.0),
                        "exp_avg": {SHARD: _chunk(full[name] * 2, world, rank)},
                        "exp_avg_sq": {SHARD: _chunk(full[name] ** 2, world, rank)},
                    }
                    for i, name in enumerate(names)
                },
                "param_groups": [{"lr": 0.003, "params": list(range(len(names)))}],
            }
        ],
        "objects": {"sampler": {"epoch": 1, "cursor": 240}},
        LAYOUT: {
            **{("model", name): [list(t.shape), DIM0] for name, t in full.items()},
            **{
                ("optimizers", 0, "state", i, key): [list(full[name].shape), DIM0]
                for i, name in enumerate(names)
                for key in ("exp_avg", "exp_avg_sq")
            },
        },
    }


def test_chunk_rows_follow_torch_chunk_and_fsdp2() -> None:
    for rows in range(0, 12):
        for parts in range(1, 6):
            expected = [c.shape[0] for c in torch.chunk(torch.zeros(rows), parts)] if rows else []
            sizes = [
                stop - start for start, stop in (chunk_rows(rows, parts, i) for i in range(parts))
            ]
            assert sizes == expected + [0] * (parts - len(expected))
    # the offsets DTensor gives (compute_local_shape_and_global_offset, checked on torch 2.13)
    assert [chunk_rows(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [chunk_rows(2, 4, i)[0] for i in range(4)] == [0, 1, 2, 2]


def test_pieces_of_a_new_chunk() -> None:
    # 7 rows: old 4 ranks hold 2, 2, 2, 1; new rank 0 of 2 holds rows 0-3 (old shards 0, 1)
    assert [(p.shard, p.start, p.stop) for p in pieces(7, old_world=4, new_world=2, rank=0)] == [
        (0, 0, 2),
        (1, 0, 2),
    ]
    # 7 rows at 2 ranks: 4, 3; new rank 1 of 3 (rows 3-5) is old 0's last row and old 1's first 2
    assert [(p.shard, p.start, p.stop) for p in pieces(7, old_world=2, new_world=3, rank=1)] == [
        (0, 3, 4),
        (1, 0, 2),
    ]
    assert pieces(2, old_world=2, new_world=4, rank=3) == []  # an empty new chunk


@pytest.mark.parametrize(
    ("old", "new"), [(4, 2), (2, 4), (3, 2), (2, 3), (1, 3), (3, 1), (4, 4), (5, 3), (2, 7)]
)
def test_resharded_pieces_equal_torch_chunk_of_the_full_tensor(old: int, new: int) -> None:
    full = _full_state()
    olds = [_payload(full, old, r) for r in range(old)]
    expected_everywhere = _full_state()  # nothing was changed in place
    for rank in range(new):
        cut = Resharder(olds[0][LAYOUT], old_world=old, new_world=new, rank=rank)
        for shard in cut.needed():
            # through the neighbour copy's flat buffer, as a staged or received copy arrives
            packed = flat.pack(olds[shard])
            buffer = torch.empty(packed.total, dtype=torch.uint8)
            flat.fill(packed, buffer)
            cut.take(
                shard, flat.unpack(flat.read_header(packed.header), buffer, torch.device("cpu"))
            )
        result = cut.result()
        want = _payload(full, new, rank)
        for name, tensor in full.items():
            got = result["model"][name][SHARD]
            assert got.shape == _chunk(tensor, new, rank).shape and got.dtype == tensor.dtype
            assert torch.equal(got, _chunk(tensor, new, rank)), (old, new, rank, name)
        state = result["optimizers"][0]["state"]
        for i in range(len(full)):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(
                    state[i][key][SHARD], want["optimizers"][0]["state"][i][key][SHARD]
                )
            assert torch.equal(state[i]["step"], torch.tensor(12.0))
        assert result["optimizers"][0]["param_groups"] == want["optimizers"][0]["param_groups"]
        assert result["objects"] == want["objects"] and result["step"] == 12
        assert result[LAYOUT] == want[LAYOUT] and result["format"] == FORMAT
    assert all(torch.equal(full[k], expected_everywhere[k]) for k in full)


def test_a_rank_takes_only_the_old_shards_it_needs() -> None:
    full = _full_state()
    layout = _payload(full, 4, 0)[LAYOUT]
    # 4 -> 2: new rank 1 holds the second half of every entry, never a row of old shard 0
    assert Resharder(layout, old_world=4, new_world=2, rank=1).needed() == [1, 2, 3]
    # 2 -> 4: every new rank needs one old shard
    assert [Resharder(layout, old_world=2, new_world=4, rank=r).needed() for r in range(4)] == [
        [0],
        [0, 1],
        [1],
        [1],
    ]
    cut = Resharder(layout, old_world=4, new_world=2, rank=1)
    cut.take(1, _payload(full, 4, 1))
    cut.take(3, _payload(full, 4, 3))
    with pytest.raises(ValueError, match=r"old shard\(s\) \[2\] not taken"):
        cut.result()


def test_what_cannot_be_resharded_is_refused() -> None:
    full = _full_state()
    layout = _payload(full, 2, 0)[LAYOUT]
    assert unsupported(layout) is None
    hsdp = dict(layout) | {("model", "head.bias"): [[2], "(2, 2) (Replicate(), Shard(dim=0))"]}
    assert unsupported(hsdp) == (
        "model.head.bias is placed (2, 2) (Replicate(), Shard(dim=0)), not on dim 0 of a 1-D mesh"
    )
    assert unsupported({}) == "the shards carry no layout"
    with pytest.raises(ValueError, match="cannot reshard in place: model.head.bias"):
        Resharder(hsdp, old_world=2, new_world=3, rank=0)
    cut = Resharder(layout, old_world=2, new_world=3, rank=0)
    with pytest.raises(ValueError, match="shape"):
        cut.take(0, _payload(full, 3, 0))  # a shard of another world size


def test_an_hsdp_layout_is_cut_over_its_shard_dim() -> None:
    """HSDP's placement (replicated, then dim 0) reshards like FSDP's over the shard dim; a layout
    that mixes the two does not."""
    from elastic_trainer.state.local_shards import DIM0, HSDP_DIM0
    from elastic_trainer.state.reshard import unsupported

    assert unsupported({("model", "w"): [[7, 3], HSDP_DIM0]}) is None
    assert unsupported({("model", "w"): [[7, 3], HSDP_DIM0], ("model", "b"): [[7], DIM0]}) == (
        "its entries are placed on meshes of different shapes"
    )
