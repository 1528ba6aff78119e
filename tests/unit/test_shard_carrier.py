"""The step's control carried by an FSDP2 reduce-scatter (``runtime/shard_carrier.py``), in three
real gloo processes: the same steps with the control on its own collective (``own``) and on the
carrier (``carry``) give bit-identical weights, the same stop flags at the same steps and the same
global losses; the smallest unit carries; a control started after the backward goes on its own
collective on every rank (and every later one too); ``close`` gives the unit FSDP's own
reduce-scatter back. Then ``Elastic`` over the sharded model: a SIGTERM on one rank stops every
rank after the same step, with the control carried at every step before.

This file is also the worker script: ``python -m tests.unit.test_shard_carrier RANK DIR``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]
WORLD, STEPS, SAMPLES = 3, 4, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    # FSDP units 0 (84 parameters), 2 (39: the smallest) and 4 (80); the root has none of its own.
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3), nn.ReLU(), nn.Linear(3, 20))


# -- worker side ---------------------------------------------------------------------------------------
def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for index in (0, 2, 4):
        fully_shard(model[index], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _channel_worker(mode: str, rank: int) -> dict[str, object]:
    """``own``/``carry``: STEPS steps through a ControlChannel; rank 1 asks to stop in step 2."""
    from elastic_trainer.runtime import torch_compat
    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.runtime.shard_carrier import ShardCarrier
    from elastic_trainer.runtime.step_control import ControlChannel

    env = read_env(
        environ={"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank)},
        cuda_devices=0,
    )
    model = _shard(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    carrier = ShardCarrier.maybe(model, env) if mode == "carry" else None
    unit = next(
        (name for name, m in model.named_modules() if m is getattr(carrier, "_unit", 0)), None
    )
    channel = ControlChannel(env, carrier=carrier)
    data = torch.randn(64, 6, generator=torch.Generator().manual_seed(rank))  # rank's own data
    losses, results, carried = [], [], []
    for step in range(1, STEPS + 1):
        batch = data[step * SAMPLES :][:SAMPLES]
        loss = model(batch).square().mean()
        losses.append(loss.item())
        late = step == STEPS  # the last control starts after the backward: it cannot ride
        if late:
            loss.backward()
        pending = channel.start(
            step,
            loss.detach() * SAMPLES,
            global_samples=SAMPLES * WORLD,
            stop=rank == 1 and step == 2,
        )
        carried.append(pending.carried)
        if not late:
            loss.backward()
        channel.wait_before_update(pending)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result = channel.finish(pending)
        results.append([result.stop, result.loss_step, result.loss, result.checkpoint_failed])
    fits_after = carrier.fits(0) if carrier is not None else None
    if carrier is not None:
        carrier.close()
    return {
        "unit": unit,
        "losses": losses,
        "results": results,
        "carried": carried,
        "fits_after_a_miss": fits_after,
        "default_again": all(
            torch_compat.fsdp_default_reduce_scatter(m)
            for m in model.modules()
            if torch_compat.is_fsdp_unit(m)
        ),
        "weights": [p.full_tensor().tolist() for p in model.parameters()],
    }


def _elastic_worker(rank: int, work: Path) -> dict[str, object]:
    """``Elastic`` over the sharded model; rank 2 SIGTERMs itself inside step 3."""
    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.runtime.settings import WorkerSettings
    from elastic_trainer.train.elastic import Elastic

    env = read_env(
        environ={"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank)},
        cuda_devices=0,
    )
    model = _shard(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(96, 6, generator=torch.Generator().manual_seed(0))
    riding: list[bool] = []
    elastic = Elastic(
        model,
        len(data),
        global_batch_size=SAMPLES * WORLD,
        max_steps=8,
        checkpoint_dir=str(work / "ckpt"),
        checkpoint_every=100,
        settings=WorkerSettings(),
        env=env,
        after_step=[
            lambda s: riding.append(elastic._carrier is not None and elastic._carrier.fits(0))
        ],
    )
    exit_code = None
    try:
        for step in elastic:
            with step:
                for micro in step:
                    if rank == 2 and step.number == 3:
                        os.kill(os.getpid(), signal.SIGTERM)
                    step.backward(model(data[list(micro.indices)]).square().mean() * step.weight)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    except SystemExit as stopped:  # a stopped run ends the loop so (no end-of-training code)
        exit_code = stopped.code
    result = elastic.result
    assert result is not None
    return {
        "step": result.step,
        "stopped": result.stopped_by_signal,
        "exit_code": exit_code,
        "riding": riding,
        "loss": result.loss,
    }


def _worker(rank: int, work: Path) -> None:
    """Every mode in one process per rank (one spawn for the file's tests)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=rank, world_size=WORLD)
    out = {mode: _channel_worker(mode, rank) for mode in ("own", "carry")}
    out["elastic"] = _elastic_worker(rank, work)
    (work / f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# -- test side -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What each of the three ranks saw, by mode."""
    work = tmp_path_factory.mktemp("shard-carrier")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.unit.test_shard_carrier", str(rank), str(work)],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-3000:]
    return [json.loads((work / f"{rank}.json").read_text()) for rank in range(WORLD)]


def test_the_carried_control_is_the_collectives_and_the_weights_do_not_change(
    ranks: list[dict],
) -> None:
    own, carry = [r["own"] for r in ranks], [r["carry"] for r in ranks]
    assert [r["unit"] for r in carry] == ["2"] * WORLD  # the unit with the fewest parameters
    assert carry[0]["carried"] == [True] * STEPS  # boarded (the last one then misses its ride)
    assert own[0]["carried"] == [False] * STEPS
    for rank in range(WORLD):
        # The gradients FSDP reduces are unchanged by the values riding after them.
        assert carry[rank]["weights"] == own[rank]["weights"]
        assert carry[rank]["losses"] == own[rank]["losses"]
        for mine, theirs in zip(carry[rank]["results"], own[rank]["results"], strict=True):
            assert mine[:2] == theirs[:2] and mine[3] == theirs[3]
            assert (mine[2] is None) == (theirs[2] is None)
            if mine[2] is not None:
                assert mine[2] == pytest.approx(theirs[2], rel=1e-6)
        # Rank 1 asked in step 2: every rank reads the stop after step 2, and only then.
        assert [r[0] for r in carry[rank]["results"]] == [False, True, False, False]
        # Step s reports the mean loss of step s - 1 over every rank's samples.
        for step in range(2, STEPS + 1):
            mean = sum(carry[r]["losses"][step - 2] for r in range(WORLD)) / WORLD
            assert carry[rank]["results"][step - 1][1] == step - 1
            assert carry[rank]["results"][step - 1][2] == pytest.approx(mean, rel=1e-6)
        # A control that missed its ride went on its own collective, and every later one will.
        assert carry[rank]["fits_after_a_miss"] is False
        assert carry[rank]["default_again"] is True


def test_elastic_over_a_sharded_model_carries_and_stops_every_rank_after_the_same_step(
    ranks: list[dict],
) -> None:
    ranks = [r["elastic"] for r in ranks]
    # Stopped after the step of the signal: its control was read right after the backward (on
    # its own collective it would be read one step later, after step 4).
    assert {r["step"] for r in ranks} == {3} and all(r["stopped"] for r in ranks)
    assert {r["exit_code"] for r in ranks} == {143}, "a stopped run's loop ends in SystemExit(143)"
    for r in ranks:
        assert r["riding"] == [True, True], r  # the steps before rode on the reduce-scatter
    assert len({r["loss"] for r in ranks}) == 1 and ranks[0]["loss"] is not None


if __name__ == "__main__":
    _worker(int(sys.argv[1]), Path(sys.argv[2]))
