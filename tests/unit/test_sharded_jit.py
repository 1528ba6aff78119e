"""The just-in-time save of sharded state (``CheckpointManager`` over a ``TrainingState`` that
keeps the neighbour copy without healing in place: plain torchrun; ``checkpoint/sharded_jit.py``)
on a real FSDP2 model over three gloo processes: after a step, rank 1 is "lost" (it writes
nothing); ranks 0 and 2 write every shard they hold without a collective, rank 1's from the
copy on rank 0, and the set is committed as a checkpoint whose metadata (every tensor's size,
chunks and offsets) and values are exactly those of a collective DCP save of the same step; a
restart's resume reads every shard back. When ranks 0 and 1 are both lost (rank 1's shard and
its copy on rank 0), rank 2's parts (its own and rank 0's copy) are not committed, and a start
names the missing shard in one line. Also: when an attempt keeps the copy (``shard_copy_use``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint import sharded
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.checkpoint.dcp_io import read_metadata
from elastic_trainer.checkpoint.manager import CheckpointManager
from elastic_trainer.checkpoint.sharded_jit import describe_incomplete
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.sampler import ElasticSampler
from elastic_trainer.state.neighbour_copy import NeighbourCopy
from elastic_trainer.state.training_state import TrainingState
from elastic_trainer.train.elastic import shard_copy_use

pytestmark = pytest.mark.timeout(120)

WORLD, STEPS = 3, 2
FINGERPRINT = {"seed": 0, "model": "test"}


def _model(world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # 7 rows and 4 rows over 3 ranks: uneven shards, and rank 2's of the last bias is empty.
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 4))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _manager(directory: Path, env: DistEnv, state: TrainingState) -> CheckpointManager:
    return CheckpointManager(
        CheckpointConfig(directory=str(directory), every=1000, jit_save=True),
        env=env,
        state=state,
        fingerprint=FINGERPRINT,
    )


def _worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        env = DistEnv(rank=rank, local_rank=rank, world_size=WORLD, local_world_size=WORLD,
                      restart_count=0, launched=True, device=torch.device("cpu"), backend="gloo")  # fmt: skip
        model = _model(WORLD)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        sampler = ElasticSampler(24, 6, seed=0)
        training = TrainingState(
            {"model": model, "optimizer": optimizer, "sampler": sampler}, env=env, seed=0
        )
        sharded_state = training.sharded
        assert sharded_state is not None and sharded_state.replicas == 1  # FSDP: a 1-D mesh
        root = Path(out)
        reference, survivors, alone = (
            _manager(root / name, env, training) for name in ("reference", "survivors", "alone")
        )
        copies = NeighbourCopy(sharded_state.local_state, env=env, every=1)
        copies.start(0)
        for step in range(1, STEPS + 1):
            torch.manual_seed(100 * step + rank)
            model(torch.randn(4, 5)).square().sum().backward()
            plan = sampler.plan(sampler.cursor, rank, WORLD)
            with copies.update(step):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sampler.advance(plan)
        copies.wait()
        # Plain torchrun: the state keeps the copy for the just-in-time save, not to heal.
        training.step = STEPS
        training.keep_copies(copies, heals=False)
        assert not training.heal_in_place, "a copy for the just-in-time save heals nothing"
        for manager in (reference, survivors, alone):
            assert manager.load() is None  # arms the just-in-time save (nothing to resume yet)
            manager.just_in_time.arm()  # the copy starts from the live state (staged and exchanged again)
        copies.wait()
        reference.save(STEPS, final=True)  # collective: the reference
        dist.barrier()
        # Rank 1 is lost: ranks 0 and 2 write what they hold, one after the other (a failure
        # of the training thread, then a save from the healer's or a stop's thread).
        for writer in (2, 0):
            if rank == writer:
                survivors.just_in_time.after_failure(RuntimeError("peer died"))
                survivors.close(1.0)  # the teardown ended: no exit timer
            dist.barrier()
        # Ranks 0 and 1 are lost: rank 2 alone (rank 1's copy was on rank 0).
        if rank == 2:
            alone.just_in_time.save("two peers died", deadline=time.monotonic() + 30)
        dist.barrier()
        # The restart's resume (every rank, a model built afresh) reads every shard back.
        fresh = _model(WORLD)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        restored = TrainingState(
            {
                "model": fresh,
                "optimizer": fresh_optimizer,
                "sampler": ElasticSampler(24, 6, seed=0),
            },
            env=env,
            seed=0,
        )
        assert _manager(root / "survivors", env, restored).load() == STEPS
        for (name, got), want in zip(
            fresh.state_dict().items(), model.state_dict().values(), strict=True
        ):
            assert torch.equal(got.to_local(), want.to_local()), name
        again = restored.objects["sampler"]
        assert isinstance(again, ElasticSampler) and again.state_dict() == sampler.state_dict()
        dist.barrier()
        Path(out, f"ok-{rank}").touch()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = tmp_path_factory.mktemp("sharded-jit")
    mp.spawn(_worker, args=(str(out / "store"), str(out)), nprocs=WORLD)
    assert sorted(p.name for p in out.glob("ok-*")) == [f"ok-{r}" for r in range(WORLD)]
    return out


def _chunks(folder: Path) -> dict[str, object]:
    metadata = read_metadata(folder)
    found: dict[str, object] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        chunks = getattr(item, "chunks", None)
        if chunks is None:
            found[fqn] = "bytes"
            continue
        found[fqn] = (
            tuple(item.size),
            item.properties.dtype,
            sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks),
        )
    return found


def _leaves(value: object, path: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() for k, v in _leaves(item, f"{path}.{key}").items()
        }
    return {path: value}


def test_the_survivors_commit_every_shard_as_a_collective_save_would(written: Path) -> None:
    assert ckpt.iter_checkpoints(written / "survivors") == [STEPS]
    info = ckpt.verify(written / "survivors", STEPS)  # the manifest and every file's sha256
    assert info.manifest.jit and info.manifest.sharded and info.manifest.world_size == WORLD
    expected = ckpt.verify(written / "reference", STEPS)
    # The same layout: every tensor's global size and chunks (rank 1's rows included, from the
    # neighbour copy), so a resharded load at any world size reads it as it reads the reference.
    # The just-in-time marker (its writer) is the one entry a collective save does not hold.
    jit = ("jit.",)
    assert {k: v for k, v in _chunks(info.path).items() if not k.startswith(jit)} == _chunks(
        expected.path
    )
    saved, reference = sharded.read_full(info.path), sharded.read_full(expected.path)
    mine, theirs = _leaves(saved), _leaves(reference)
    assert {k for k in mine if not k.startswith(".jit.")} == theirs.keys()
    for name, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(mine[name], value), name  # type: ignore[arg-type]
        else:
            assert mine[name] == value, name
    # What the resume reads besides the state (the CheckpointManager's payload).
    assert {".step", ".world_size", ".format", ".fingerprint", ".rng.scheme"} <= mine.keys()
    assert int(saved["step"]) == STEPS


def test_a_shard_lost_with_its_copy_is_no_checkpoint_and_is_named(written: Path) -> None:
    assert ckpt.iter_checkpoints(written / "alone") == []
    # Rank 2 wrote its own shard and rank 0's (the copy it holds) of the step it holds (the copy
    # started again from step 2 when the save was armed); rank 1's is gone.
    folders = sorted((written / "alone").glob(".ckpt-*.dcp.tmp-*"))
    assert [f.name.split(".")[1] for f in folders] == ["ckpt-000000000002"]
    assert sorted(p.name for p in folders[0].glob("rank-*.done")) == [
        "rank-0.done",
        "rank-2.done",
    ]
    line = describe_incomplete(written / "alone", None)
    assert line == (
        "the just-in-time checkpoint of step 2 is incomplete: rank(s) 1's shards of it survived "
        "nowhere (neither the rank nor its neighbour copy held them); resuming from scratch: 2 "
        "step(s) redone"
    )
    assert describe_incomplete(written / "survivors", STEPS) is None


@pytest.mark.parametrize(
    ("heals", "every", "world", "jit", "use"),
    [
        (True, 1, 3, True, "heal"),
        (True, 0, 3, False, "heal"),  # off: the heal reloads the newest checkpoint in place
        (False, 1, 3, True, "save"),  # plain torchrun, or no rebuild: for the just-in-time save
        (False, 3, 2, True, "save"),
        (False, 0, 3, True, None),  # the copy is off
        (False, 1, 1, True, None),  # no neighbour
        (False, 1, 3, False, None),  # no just-in-time save (no directory, or jit_save off)
    ],
)
def test_when_an_attempt_keeps_the_neighbour_copy(
    heals: bool, every: int, world: int, jit: bool, use: str | None
) -> None:
    got = shard_copy_use(heals=heals, every=every, world_size=world, saves_just_in_time=jit)
    assert got == use
    # An HSDP mesh's parts cannot be placed by the save (its replicas are its copies).
    assert shard_copy_use(
        heals=heals, every=every, world_size=world, saves_just_in_time=jit, one_dim=False
    ) == ("heal" if heals else None)
