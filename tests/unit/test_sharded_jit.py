"""The just-in-time save of a sharded loop (``checkpoint/sharded_jit.py``) on a real FSDP2 model over
three gloo processes with the neighbour copy on: after a step, rank 1 is "lost" (it writes
nothing); ranks 0 and 2 write every shard they hold without a collective, rank 1's from the
copy on rank 0, and the set is committed as a checkpoint whose metadata (every tensor's size,
chunks and offsets) and values are exactly those of a collective DCP save of the same step.
When ranks 0 and 1 are both lost (rank 1's shard and its copy on rank 0), rank 2's parts (its
own and rank 0's copy) are not committed, and a start names the missing shard in one line.
The ``Trainer``'s and ``Elastic``'s route (``CheckpointManager`` over a ``TrainingState`` that
keeps the copy without healing in place: plain torchrun) commits rank 1's shards from the copy
too, and its resume reads them back; and when an attempt keeps the copy (``shard_copy_use``).
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
from elastic_trainer.checkpoint.sharded_manager import ShardedCheckpointManager
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.sampler import ElasticSampler
from elastic_trainer.state.neighbour_copy import NeighbourCopy
from elastic_trainer.state.sharded import ShardedState
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


def _manager(directory: Path, env: DistEnv, state: ShardedState) -> ShardedCheckpointManager:
    return ShardedCheckpointManager(
        CheckpointConfig(directory=str(directory), every=1000, jit_save=True),
        env=env,
        state=state,
        fingerprint=FINGERPRINT,
    )


def _trainer_manager(directory: Path, env: DistEnv, state: TrainingState) -> CheckpointManager:
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
        state = ShardedState(model, [optimizer], objects={"sampler": sampler})
        root = Path(out)
        reference, survivors, alone = (
            _manager(root / name, env, state) for name in ("reference", "survivors", "alone")
        )
        training = TrainingState(
            {"model": model, "optimizer": optimizer, "sampler": sampler}, env=env, seed=0
        )
        trainer = _trainer_manager(root / "trainer", env, training)
        copies = NeighbourCopy(state.local_state, env=env, every=1)
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
        reference.save(STEPS, epoch=sampler.epoch, final=True)  # collective: the reference
        dist.barrier()
        # Rank 1 is lost: ranks 0 and 2 write what they hold, one after the other.
        for writer in (2, 0):
            if rank == writer:
                with (
                    pytest.raises(RuntimeError, match="peer died"),
                    survivors.just_in_time(copies),
                ):
                    raise RuntimeError("peer died")
            dist.barrier()
        # Ranks 0 and 1 are lost: rank 2 alone (rank 1's copy was on rank 0).
        if rank == 2:
            with pytest.raises(RuntimeError), alone.just_in_time(copies):
                raise RuntimeError("two peers died")
        dist.barrier()
        # The Trainer's route under plain torchrun: the state keeps the copy without healing.
        training.step = STEPS
        training.keep_copies(copies, heals=False)
        assert not training.heal_in_place, "a copy for the just-in-time save heals nothing"
        assert trainer.load() is None  # arms the just-in-time save (nothing to resume yet)
        trainer.arm()  # the copy starts from the live state (staged and exchanged again)
        copies.wait()
        dist.barrier()
        for writer in (2, 0):  # rank 1 is lost again
            if rank == writer:
                outcome = trainer.save_just_in_time("peer died", deadline=time.monotonic() + 30)
                assert outcome.saved, outcome
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
        assert _trainer_manager(root / "trainer", env, restored).load() == STEPS
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
    assert _chunks(info.path) == _chunks(expected.path)
    saved, reference = sharded.read_full(info.path), sharded.read_full(expected.path)
    assert saved.keys() == reference.keys()
    mine, theirs = _leaves(saved), _leaves(reference)
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(mine[name], value), name  # type: ignore[arg-type]
        else:
            assert mine[name] == value, name
    assert int(saved["step"]) == STEPS


def test_a_shard_lost_with_its_copy_is_no_checkpoint_and_is_named(written: Path) -> None:
    assert ckpt.iter_checkpoints(written / "alone") == []
    # Rank 2 wrote its own shard and rank 0's (the copy it holds) of each step it holds (two
    # generations); rank 1's is gone.
    folders = sorted((written / "alone").glob(".ckpt-*.dcp.tmp-*"))
    assert [f.name.split(".")[1] for f in folders] == ["ckpt-000000000001", "ckpt-000000000002"]
    assert sorted(p.name for p in folders[1].glob("rank-*.done")) == [
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


def test_the_trainers_route_commits_the_lost_ranks_shards_from_the_copy(written: Path) -> None:
    # Without the copy the survivors wrote their own shards only, and no checkpoint counted.
    assert ckpt.iter_checkpoints(written / "trainer") == [STEPS]
    info = ckpt.verify(written / "trainer", STEPS)
    assert info.manifest.jit and info.manifest.sharded and info.manifest.world_size == WORLD
    # Rank 1's rows (from the copy) are where a collective save puts them, with its values.
    expected = ckpt.verify(written / "reference", STEPS).path
    shards = ("model.", "optimizer.")
    got_chunks, want_chunks = _chunks(info.path), _chunks(expected)
    assert {k: v for k, v in got_chunks.items() if k.startswith(shards)} == {
        k: v for k, v in want_chunks.items() if k.startswith(shards)
    }
    got, want = _leaves(sharded.read_full(info.path)), _leaves(sharded.read_full(expected))
    for name, value in want.items():
        if name.startswith((".model.", ".optimizer.state.")):
            assert isinstance(value, torch.Tensor) and torch.equal(got[name], value), name  # type: ignore[arg-type]
    # What the Trainer's resume reads besides the state (its CheckpointManager's payload).
    assert {".step", ".world_size", ".format", ".fingerprint", ".rng.scheme"} <= got.keys()


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
