"""Survivors renumbered at the same world size (issue 32): four real gloo processes train an
FSDP2 model two steps with the neighbour copy, then form a new group in which old ranks 0 and 2
have swapped places; the shards are moved in memory (``plan_restore`` -> ``plan_reshard`` +
``reshard_shards``), put into a model sharded anew, and a collective DCP save of it commits the
state trained before the renumbering, every row at its place.

The cause of the one failed run (``docs/design/sharded.md``): DTensor's sharding caches hand a
model sharded on the new mesh the old, *equal* mesh object, with this process's old coordinate,
which DCP's offsets follow. The test pins that torch behaviour (a model sharded without
clearing the caches carries the old coordinate) and runs the heal's path with the caches
cleared, as ``Attempt.groups`` does.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint import sharded
from elastic_trainer.heal.shard_move import reshard_shards
from elastic_trainer.heal.sharded_restore import plan_restore
from elastic_trainer.runtime import torch_compat
from elastic_trainer.state.neighbour_copy import NeighbourCopy
from elastic_trainer.state.sharded import ShardedState
from tests.support.dist_env import cpu_env

pytestmark = pytest.mark.timeout(180)

WORLD, STEPS = 4, 2
NEW_RANK = (2, 1, 0, 3)  # old rank -> new rank: 0 and 2 swap


def _model() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 4))  # 7 rows: uneven
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(state: ShardedState) -> dict[str, torch.Tensor]:
    payload = state.state_dict()
    flat = {f"model.{k}": v.full_tensor() for k, v in payload["model"].items()}
    for name, entry in payload["optimizer"]["state"].items():
        for key, value in entry.items():
            if hasattr(value, "full_tensor"):
                flat[f"optimizer.state.{name}.{key}"] = value.full_tensor()
    return flat


def _coordinate(model: nn.Module) -> tuple[int, ...] | None:
    return model[0].weight.device_mesh.get_coordinate()  # type: ignore[index, union-attr]


def _worker(old: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/s1", rank=old, world_size=WORLD)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = ShardedState(model, [optimizer])
    copies = NeighbourCopy(state.local_state, env=cpu_env(old, WORLD, launched=True), every=1)
    copies.start(0)
    for step in range(1, STEPS + 1):
        torch.manual_seed(100 * step + old)
        model(torch.randn(4, 5)).square().sum().backward()
        with copies.update(step):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    copies.wait()
    before = _full(state)
    held = copies.holdings()
    dist.destroy_process_group()

    new = NEW_RANK[old]
    dist.init_process_group("gloo", init_method=f"file://{root}/s2", rank=new, world_size=WORLD)
    try:
        # The cause: sharded on the new group, the model keeps the old coordinate ...
        assert _coordinate(_model()) == (old,)
        # ... unless DTensor's caches are emptied first (what Attempt.groups does after a heal).
        torch_compat.clear_dtensor_sharding_caches()
        fresh = _model()
        assert _coordinate(fresh) == (new,)

        members: list[object] = [None] * WORLD
        dist.all_gather_object(members, held)
        plan = plan_restore(members, WORLD)  # type: ignore[arg-type]
        assert (plan.step, plan.old_world, plan.new_world) == (STEPS, WORLD, WORLD), plan
        payload, refused = reshard_shards(copies, plan, rank=new)
        assert refused is None and payload is not None
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        fresh_state = ShardedState(fresh, [fresh_optimizer])
        assert fresh_state.load_local_state(payload) == STEPS
        after = _full(fresh_state)
        assert after.keys() == before.keys()
        assert all(torch.equal(after[k], before[k]) for k in before), "values moved wrongly"
        writer = sharded.ShardedCheckpointer(
            Path(root) / "ckpt", rank=new, world_size=WORLD, fingerprint_fields={}, keep_last=None
        )
        writer.save(fresh_state.state_dict(), step=STEPS, epoch=0, sync=True)
        if new == 0:
            saved = sharded.read_full(ckpt.verify(Path(root) / "ckpt", STEPS).path)
            for key, value in before.items():
                kind, rest = key.split(".", 1)
                if kind == "model":
                    got = saved["model"][rest]
                else:
                    name, entry = rest.removeprefix("state.").rsplit(".", 1)
                    got = saved["optimizer"]["state"][name][entry]
                assert torch.equal(got, value), f"{key}: rows at another rank's place"
        Path(root, f"ok-{old}").touch()
    finally:
        dist.destroy_process_group()


def test_survivors_renumbered_at_the_same_size_reshard_and_save(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(str(tmp_path),), nprocs=WORLD, start_method="forkserver")
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == [f"ok-{r}" for r in range(WORLD)]


def _hsdp_model(world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 4))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _hsdp_worker(rank: int, root: str) -> None:
    """HSDP 2 x 2 trains two steps; the node of ranks 2 and 3 (replica 1) is lost; ranks 0 and 1
    heal at 2 x 1 from their own shards, cut over the shard dim, in memory."""
    from elastic_trainer.heal.sharded_restore import RESTORE, RestorePlan, restore_shards
    from elastic_trainer.state.local_shards import HSDP_DIM0, LAYOUT

    dist.init_process_group("gloo", init_method=f"file://{root}/h1", rank=rank, world_size=WORLD)
    model = _hsdp_model(WORLD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = ShardedState(model, [optimizer])
    copies = NeighbourCopy(
        state.local_state, env=cpu_env(rank, WORLD, launched=True), every=1, replicas=2
    )
    copies.start(0)
    for step in range(1, STEPS + 1):
        torch.manual_seed(100 * step + rank % 2)  # the replicas of a shard see the same batch
        model(torch.randn(4, 5)).square().sum().backward()
        with copies.update(step):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    before = _full(state)
    assert {p for _, p in state.local_state(STEPS)[LAYOUT].values()} == {HSDP_DIM0}
    dist.destroy_process_group()
    if rank >= 2:
        Path(root, f"hsdp-ok-{rank}").touch()
        return
    dist.init_process_group("gloo", init_method=f"file://{root}/h2", rank=rank, world_size=2)
    try:
        healed = restore_shards(copies, rank=rank, world_size=2)
        assert healed is not None and healed["payload"] is not None
        plan = RestorePlan.from_json(healed[RESTORE])
        assert (plan.step, plan.old_shards, plan.new_shards, plan.redone) == (STEPS, 2, 1, 0)
        torch_compat.clear_dtensor_sharding_caches()
        fresh = _hsdp_model(2)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        fresh_state = ShardedState(fresh, [fresh_optimizer])
        assert fresh_state.load_local_state(healed["payload"]) == STEPS
        after = _full(fresh_state)
        assert after.keys() == before.keys()
        assert all(torch.equal(after[k], before[k]) for k in before), "values moved wrongly"
        Path(root, f"hsdp-ok-{rank}").touch()
    finally:
        dist.destroy_process_group()


def test_hsdp_2x2_to_2x1_reshards_in_memory(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_hsdp_worker, args=(str(tmp_path),), nprocs=WORLD, start_method="forkserver")
    assert sorted(p.name for p in tmp_path.glob("hsdp-ok-*")) == [
        f"hsdp-ok-{r}" for r in range(WORLD)
    ]
