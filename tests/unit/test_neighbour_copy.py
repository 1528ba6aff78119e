"""The neighbour copy (``state/neighbour_copy.py``) and the local-shard payload
(``state/local_shards.py``) on a real FSDP2 model over three gloo processes: each rank ends up
holding its neighbour's shard of the last step, byte for byte, two generations of it, refreshed
only at the interval; a rank's shard put back into a model sharded anew trains on bitwise as the
live one does. Plus the setting's precedence and validation (no processes)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.state import flat
from elastic_trainer.state.local_shards import load_local_state, local_state
from elastic_trainer.state.neighbour_copy import (
    ENV_SHARD_COPY_EVERY,
    NeighbourCopy,
    NeighbourCopyConfig,
    neighbour_of,
)

WORLD = 3


def _model(device: torch.device, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 4)
    )  # 7 and 4 rows: uneven shards
    model.to(device)
    mesh = init_device_mesh(device.type, (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> None:
    torch.manual_seed(100 * step + rank)
    device = next(model.parameters()).device
    model(torch.randn(4, 5).to(device)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _flat(payload: object) -> list[torch.Tensor]:
    return [t.cpu() for t in flat.pack(payload).tensors]


def _worker(
    rank: int, store_path: str, out: str, device_type: str = "cpu", world: int = WORLD
) -> None:
    """One rank: train 4 steps with two copies (every step, every other step), then check what it
    holds. On CUDA (``tests/gpu``): NCCL trains, the staging goes to pinned host memory on a side
    stream, the exchange stays on gloo."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"file://{store_path}", rank=rank, world_size=world
    )
    try:
        env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                      restart_count=0, launched=True, device=device, backend=backend)  # fmt: skip
        model = _model(device, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        counter = Counter()
        source = lambda s: local_state(model, [optimizer], {"counter": counter}, step=s)  # noqa: E731
        copies = NeighbourCopy(source, env=env, every=1)
        sparse = NeighbourCopy(source, env=env, every=2)  # the same state, every other step
        copies.start(0)
        sparse.start(0)
        for step in range(1, 5):
            _train(model, optimizer, step, rank)
            with copies.update(step), sparse.update(step):
                counter.n += 1
        copies.wait()
        sparse.wait()
        torch.save(_flat(source(4)), f"{out}/live-{rank}.pt")
        dist.barrier()
        neighbour = neighbour_of(rank, world)
        if device_type == "cuda":
            assert all(slot.flat.is_pinned() for slot in copies._own if slot.flat.numel())
        for every, held_by in ((1, copies), (2, sparse)):
            holdings = held_by.holdings()
            expected_steps = [s for s in (0, 1, 2, 3, 4) if s % every == 0][-2:]
            assert sorted(holdings.own) == expected_steps, holdings
            assert sorted(holdings.copies) == [(neighbour, s) for s in expected_steps], holdings
            assert holdings.live == 4
        assert sparse.refreshes == 3 and copies.refreshes == 5
        # The copy this rank holds is its neighbour's live shard of step 4, byte for byte.
        theirs = torch.load(f"{out}/live-{neighbour}.pt", weights_only=True)
        held = copies.payload("copy", shard=neighbour, step=4)
        assert held["objects"]["counter"] == {"n": 4} and held["step"] == 4
        mine = _flat(held)
        assert len(mine) == len(theirs)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
        # Its own staged shard of step 3, put into a model sharded anew, trains on bitwise as
        # the live model does from step 3 (which it does not hold any more: replay step 4).
        staged = copies.payload("own", shard=rank, step=3)
        fresh = _model(device, world)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        fresh_counter = Counter()
        assert load_local_state(fresh, [fresh_optimizer], {"counter": fresh_counter}, staged) == 3
        assert fresh_counter.n == 3
        _train(fresh, fresh_optimizer, 4, rank)
        replayed = _flat(local_state(fresh, [fresh_optimizer], {"counter": counter}, step=4))
        live = _flat(local_state(model, [optimizer], {"counter": counter}, step=4))
        assert all(torch.equal(a, b) for a, b in zip(replayed, live, strict=True))
        with pytest.raises(LookupError):
            copies.payload("copy", shard=neighbour, step=1)
        Path(f"{out}/ok-{rank}").touch()
    finally:
        dist.destroy_process_group()


def test_each_rank_holds_its_neighbours_shard(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(tmp_path, "cpu", WORLD)


def run_ranks(tmp_path: Path, device_type: str, world: int) -> None:
    """Spawn ``world`` ranks of :func:`_worker`; each leaves a mark when every check held."""
    mp.spawn(
        _worker, args=(str(tmp_path / "store"), str(tmp_path), device_type, world), nprocs=world
    )
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == [f"ok-{r}" for r in range(world)]


def test_the_interval_setting() -> None:
    assert NeighbourCopyConfig().every == 1
    assert NeighbourCopyConfig.from_environ({ENV_SHARD_COPY_EVERY: "4"}).every == 4
    assert NeighbourCopyConfig.from_environ({ENV_SHARD_COPY_EVERY: "4"}, every=0).every == 0
    with pytest.raises(ConfigError, match=ENV_SHARD_COPY_EVERY):
        NeighbourCopyConfig.from_environ({ENV_SHARD_COPY_EVERY: "often"})
    with pytest.raises(ConfigError, match="shard_copy.every"):
        NeighbourCopyConfig(every=-1)


def test_off_and_single_rank_send_nothing() -> None:
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, restart_count=0,
                  launched=False, device=torch.device("cpu"), backend="gloo")  # fmt: skip
    calls: list[int] = []
    copies = NeighbourCopy(lambda s: calls.append(s) or {}, env=env, every=1)
    with copies.update(1):
        pass
    assert copies.mode == "off" and calls == [] and copies.holdings().live == 1


def _replica_copy(staged: list[int]) -> NeighbourCopy:
    """Rank 0 of two HSDP replicas: it only stages its own shard (no group, no process)."""
    env = DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2, restart_count=0,
                  launched=False, device=torch.device("cpu"), backend="gloo")  # fmt: skip
    copies = NeighbourCopy(
        lambda s: staged.append(s) or {"step": torch.tensor([s])}, env=env, every=1, replicas=2
    )
    assert copies.mode == "replica"
    return copies


def test_a_finishing_stop_stages_the_update_under_way_then_parks_the_training_thread() -> None:
    """A stop signal inside the update of step 3: step 3 is staged before the training thread
    parks (a plain stop parks it unstaged: its peers that ended step 3 first hold 3, it 2)."""
    staged: list[int] = []
    copies = _replica_copy(staged)
    copies.start(0)
    inside, release, ended = threading.Event(), threading.Event(), []

    def train() -> None:
        for step in (1, 2, 3, 4):
            with copies.update(step):
                if step == 3:
                    inside.set()
                    release.wait(10)
            ended.append(step)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    assert inside.wait(10)
    stopper = threading.Thread(target=lambda: ended.append(copies.stop_after_update(10.0)))
    stopper.start()
    time.sleep(0.2)
    assert stopper.is_alive(), "it waits for the update under way to end"
    release.set()
    stopper.join(10)
    assert ended == [1, 2, True], "step 3's update ended, staged, and the thread parked in it"
    assert sorted(copies.holdings().own) == [2, 3] and staged[-1] == 3
    time.sleep(0.1)
    assert trainer.is_alive() and 4 not in staged, "nothing after step 3"


def test_a_finishing_stop_keeps_what_is_staged_when_no_update_ends() -> None:
    """No update ends (as for a training thread blocked in a collective with a peer that
    parked): the stop waits out its bound and keeps the staged steps."""
    staged: list[int] = []
    copies = _replica_copy(staged)
    copies.start(0)
    for step in (1, 2):
        with copies.update(step):
            pass
    started = time.monotonic()
    assert copies.stop_after_update(0.3) is False
    assert 0.3 <= time.monotonic() - started < 5
    assert sorted(copies.holdings().own) == [1, 2]
    assert 0.5 <= copies.finish_timeout() <= 5.0


def test_a_finishing_stop_waits_three_recent_steps_within_bounds() -> None:
    copies = _replica_copy([])
    assert copies.finish_timeout() == 5.0, "no step measured yet: the ceiling"
    copies.step_s = 0.05
    assert copies.finish_timeout() == 0.5
    copies.step_s = 1.0
    assert copies.finish_timeout() == 3.0
    copies.step_s = 60.0
    assert copies.finish_timeout() == 5.0
