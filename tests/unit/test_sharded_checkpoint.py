"""Sharded (DCP) checkpoints with real gloo processes and ``fully_shard``: two ranks save
asynchronously into reused host buffers, three ranks and one rank load the same checkpoint
resharded and hold exactly the saved model and optimizer; the files' manifest, fallback past a
damaged checkpoint, pruning, quarantine, another job's refusal, the safe readers and ``export``.

One save run (module fixture) serves every test; each destructive test works on a copy.
This file is also the worker script: ``python -m tests.unit.test_sharded_checkpoint ROLE ...``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint import sharded
from elastic_trainer.checkpoint.dcp_io import METADATA_FILE, read_metadata

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = {"seed": 0, "model": [["0.weight", [33, 16], "float32"]]}
SAVE_STEPS = (2, 4, 6)


# -- worker side ---------------------------------------------------------------------------------------
DEVICE = os.environ.get("SHARDED_TEST_DEVICE", "cpu")
"""``cuda``: the workers run on NCCL, one GPU each (tests/gpu/test_sharded_nccl.py)."""


def _model(world_size: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 4)
    ).to(DEVICE)
    mesh = init_device_mesh(DEVICE, (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(obj: Any) -> Any:
    if hasattr(obj, "full_tensor"):
        return obj.full_tensor().cpu()
    if isinstance(obj, dict):
        return {key: _full(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_full(value) for value in obj]
    return obj


def _jit_worker(role: str, rank: int, world_size: int, work: Path, model: Any, opt: Any) -> None:
    """The just-in-time save of a sharded TrainingState through the CheckpointManager: every rank
    writes its own shards without a collective (the process group is destroyed first), the last
    one commits; then another world size loads it through the manager."""
    import time

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from elastic_trainer.checkpoint.config import CheckpointConfig
    from elastic_trainer.checkpoint.manager import CheckpointManager
    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.runtime.sampler import ElasticSampler
    from elastic_trainer.runtime.settings import WorkerSettings
    from elastic_trainer.state.training_state import TrainingState

    env = read_env(
        environ={"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)},
        cuda_devices=torch.cuda.device_count() if DEVICE == "cuda" else 0,
    )
    sampler = ElasticSampler(64, 8, seed=0)
    state = TrainingState({"model": model, "optimizer": opt, "sampler": sampler}, env=env, seed=0)
    manager = CheckpointManager(
        CheckpointConfig(directory=str(work / "jit"), every=1000, jit_save=True),
        env=env,
        state=state,
        fingerprint=FINGERPRINT,
        settings=WorkerSettings(),
    )
    resumed = manager.load()
    if role == "jit-load":
        full = {"model": _full(get_state_dict(model, opt)[0])}
        reference = torch.load(work / "jit-ref.pt", weights_only=True)
        (work / f"jit-loaded-{world_size}-{rank}.json").write_text(
            json.dumps(
                {
                    "resumed": resumed,
                    "model": all(torch.equal(full["model"][k], v) for k, v in reference.items()),
                    "cursor": sampler.state_dict()["cursor"],
                }
            )
        )
        dist.destroy_process_group()
        return
    manager.just_in_time.arm()
    for step in (1, 2):
        torch.manual_seed(200 + step)
        model(torch.randn(8, 16).to(DEVICE)).square().mean().backward()
        with state.update(step):
            opt.step()
            opt.zero_grad()
            sampler.advance(next(iter(sampler.plans(rank, world_size))))
    reference = _full(get_state_dict(model, opt)[0])
    if rank == 0:
        torch.save(reference, work / "jit-ref.pt")
        # A part alone is no checkpoint: rank 0's shards of a step rank 1 never writes.
        assert manager._sharded is not None
        alone = manager._sharded.save_own(manager._payload(state.snapshot()), step=99, epoch=0)
        (work / "alone").write_text(str(alone))
    dist.barrier()
    dist.destroy_process_group()  # the group is gone, as after a failure
    time.sleep(0.5 * rank)  # the ranks save one after the other
    outcome = manager.just_in_time.save("test", deadline=time.monotonic() + 60)
    (work / f"jit-{rank}.json").write_text(
        json.dumps({"saved": outcome.saved, "path": outcome.path})
    )


def _stop_worker(rank: int, world_size: int, work: Path, model: Any, opt: Any) -> None:
    """A stop signal while a periodic sharded save is slow (no neighbour copy): (1) the step after
    the save is slow while the save's background write is in flight; (2) later, a step is slow
    with no write in flight, so the stall monitor fires while FSDP2's unsharded parameters are
    live. Neither may read the live state from the monitor's thread or write the step again."""
    import signal
    import threading
    import time

    import torch.distributed as dist

    from elastic_trainer.checkpoint.config import CheckpointConfig
    from elastic_trainer.checkpoint.manager import CheckpointManager
    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.runtime.sampler import ElasticSampler
    from elastic_trainer.runtime.settings import WorkerSettings
    from elastic_trainer.state.training_state import TrainingState

    env = read_env(
        environ={"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)},
        cuda_devices=0,
    )
    sampler = ElasticSampler(64, 8, seed=0)
    state = TrainingState({"model": model, "optimizer": opt, "sampler": sampler}, env=env, seed=0)
    manager = CheckpointManager(
        CheckpointConfig(directory=str(work / "stop"), every=2, jit_save=True),
        env=env,
        state=state,
        fingerprint=FINGERPRINT,
        settings=WorkerSettings(),
    )
    manager.load()
    writer = manager._sharded
    assert writer is not None
    real_write, real_save_own = writer._write, writer.save_own
    exits: list[int] = []
    jit_writes: list[int] = []

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        time.sleep(3.0)  # the periodic save's background write (DCP's collectives and files)
        return real_write(*args, **kwargs)

    def counted_save_own(state_: Any, *, step: int, epoch: int) -> Any:
        jit_writes.append(step)
        return real_save_own(state_, step=step, epoch=epoch)

    writer._write = slow_write  # type: ignore[method-assign]
    writer.save_own = counted_save_own  # type: ignore[method-assign]
    manager.just_in_time.arm()
    manager.just_in_time._exit = exits.append  # the monitor's exit, recorded instead
    stall: list[Any] = [None]  # what the slow step waits for inside the model's forward

    def slow_forward(module: Any, args: Any) -> None:  # after FSDP2's unshard of this layer
        wait = stall[0]
        if wait is not None:
            wait()

    model[2].register_forward_pre_hook(slow_forward)
    errors: list[str] = []

    def step(number: int) -> None:
        torch.manual_seed(300 + number)
        model(torch.randn(8, 16)).square().mean().backward()
        with state.update(number):
            opt.step()
            opt.zero_grad()
            sampler.advance(next(iter(sampler.plans(rank, world_size))))
        state.guard.boundary()
        manager.save(number)  # when due

    try:
        step(1)
        step(2)  # the periodic save of step 2: its background write takes 3 s
        manager.just_in_time.on_signal(signal.SIGTERM)
        stall[0] = lambda: time.sleep(2.0)  # slower than STALL_MIN_S, slowed by the write
        step(3)
        writer.wait(30)
        monitor = manager.just_in_time._monitor
        assert monitor is not None

        def until_the_monitor_decides() -> None:  # no write in flight: a stall now
            deadline = time.monotonic() + 20
            while monitor.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)

        stall[0] = until_the_monitor_decides
        step(4)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.append(f"{type(exc).__name__}: {exc}")
    manager.just_in_time.stand_down()
    monitor_alive = (
        manager.just_in_time._monitor is not None and manager.just_in_time._monitor.is_alive()
    )
    with_threads = [t.name for t in threading.enumerate()]
    (work / f"stop-{rank}.json").write_text(
        json.dumps(
            {
                "errors": errors,
                "exits": exits,
                "jit_writes": jit_writes,
                "monitor_alive": monitor_alive,
                "threads": with_threads,
            }
        )
    )
    if not errors:
        manager.close(30)
        dist.destroy_process_group()


def _worker(role: str, rank: int, world_size: int, work: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if DEVICE == "cuda" else "gloo",
        init_method=f"file://{work / f'store-{role}'}",
        rank=rank,
        world_size=world_size,
    )
    model, opt = _model(world_size)
    if role.startswith("jit"):
        _jit_worker(role, rank, world_size, work, model, opt)
        return
    if role == "stop":
        _stop_worker(rank, world_size, work, model, opt)
        return
    checkpointer = sharded.ShardedCheckpointer(
        work / "ckpt", rank=rank, world_size=world_size, fingerprint_fields=FINGERPRINT, keep_last=2
    )
    if role == "save":
        for step in range(1, SAVE_STEPS[-1] + 1):
            torch.manual_seed(100 + step)
            model(torch.randn(8, 16).to(DEVICE)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step in SAVE_STEPS:
                msd, osd = get_state_dict(model, opt)
                payload = {
                    "model": msd,
                    "optimizer": osd,
                    "step": step,
                    "extra": {"epoch": step // 4},
                }
                (work / f"nbytes-{rank}").write_text(str(sharded.local_nbytes(payload)))
                checkpointer.save(payload, step=step, epoch=step // 4)  # asynchronous
                reference = {
                    "model": _full(msd),
                    "optimizer": _full(osd),
                }  # the training thread goes on
                if rank == 0:
                    torch.save(reference, work / f"ref-{step}.pt")
        checkpointer.wait()
        (work / f"allocations-{rank}").write_text(str(checkpointer.stager.allocations))
        (work / f"pinned-{rank}").write_text(str(checkpointer.stager.pinned))
    else:
        msd, osd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": msd, "optimizer": osd, "step": 0, "extra": {"epoch": -1}}
        info = ckpt.find_latest(work / "ckpt")
        assert info is not None
        checkpointer.load(info, state)
        set_state_dict(
            model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        now = get_state_dict(model, opt)
        full = {"model": _full(now[0]), "optimizer": _full(now[1])}
        reference = torch.load(work / f"ref-{info.step}.pt", weights_only=True)
        same = all(torch.equal(full["model"][k], v) for k, v in reference["model"].items())
        same_opt = all(
            torch.equal(full["optimizer"]["state"][k][name], value)
            for k, entry in reference["optimizer"]["state"].items()
            for name, value in entry.items()
        )
        (work / f"loaded-{world_size}-{rank}.json").write_text(
            json.dumps(
                {
                    "step": state["step"],
                    "epoch": state["extra"]["epoch"],
                    "model": same,
                    "optimizer": same_opt,
                    "local_rows": int(
                        dict(model.named_parameters())["0.weight"].to_local().shape[0]
                    ),
                }
            )
        )
    dist.destroy_process_group()


# -- test side -----------------------------------------------------------------------------------------
def _run(role: str, world_size: int, work: Path, device: str = "cpu") -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "SHARDED_TEST_DEVICE": device,
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.unit.test_sharded_checkpoint",
                role,
                str(rank),
                str(world_size),
                str(work),
            ],
            cwd=ROOT,
            # Each node's torchrun agent counts its own restarts: ranks of one group may differ
            # (the temporary directory's name must not depend on it; found by demo --sharded).
            env={**env, "TORCHELASTIC_RESTART_COUNT": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    errors = [proc.communicate(timeout=90)[1] for proc in procs]
    for proc, err in zip(procs, errors, strict=True):
        assert proc.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("sharded")
    _run("save", 2, work)
    return work


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_two_ranks_write_their_own_shards_and_commit_a_manifest(saved: Path) -> None:
    directory = saved / "ckpt"
    # keep_last=2: step 2 was pruned, 4 and 6 are complete; no temporary directory is left.
    assert ckpt.iter_checkpoints(directory) == [4, 6]
    assert sorted(p.name for p in directory.iterdir()) == [
        "ckpt-000000000004.dcp",
        "ckpt-000000000004.json",
        "ckpt-000000000006.dcp",
        "ckpt-000000000006.json",
    ]
    info = ckpt.verify(directory, 6)
    assert info.manifest.sharded and info.manifest.world_size == 2 and info.manifest.epoch == 1
    listed = info.manifest.files or {}
    assert (
        METADATA_FILE in listed and sum(name.endswith(".distcp") for name in listed) == 2
    )  # one per rank
    assert info.manifest.nbytes == sum(size for _, size in listed.values())
    # What a save reports as written: each rank's own shards (the two halves of every tensor,
    # and the optimizer's step scalars, which every rank holds), not nothing, not everything.
    reference = torch.load(saved / "ref-6.pt", weights_only=True)
    full = sum(t.numel() * t.element_size() for t in _tensors(reference))
    written = [int((saved / f"nbytes-{rank}").read_text()) for rank in (0, 1)]
    assert all(0.4 * full < n < 0.6 * full for n in written), (written, full)
    assert 0 <= sum(written) - full <= 64, (written, full)
    # The host buffers were allocated once and reused by the two later saves; not pinned without CUDA.
    assert [(saved / f"allocations-{rank}").read_text() for rank in (0, 1)] == ["1", "1"]
    assert (saved / "pinned-0").read_text() == "False"


@pytest.mark.parametrize("world_size", [3, 1])
def test_loads_resharded_at_another_world_size(
    saved: Path, world_size: int, tmp_path: Path
) -> None:
    work = tmp_path
    _copy(saved, work)
    shutil.copy(saved / "ref-6.pt", work / "ref-6.pt")
    _run("load", world_size, work)
    results = [
        json.loads((work / f"loaded-{world_size}-{rank}.json").read_text())
        for rank in range(world_size)
    ]
    assert all(r["model"] and r["optimizer"] for r in results), results
    assert all(r["step"] == 6 and r["epoch"] == 1 for r in results)
    # The 33 rows of the first layer are spread over the new world size.
    assert (
        sum(r["local_rows"] for r in results) == 33 and len({r["local_rows"] for r in results}) >= 1
    )


def test_just_in_time_every_rank_writes_its_shards_without_a_collective(tmp_path: Path) -> None:
    _run("jit", 2, tmp_path)
    outcomes = [json.loads((tmp_path / f"jit-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(o["saved"] for o in outcomes), outcomes
    assert outcomes[1]["path"].endswith("ckpt-000000000002.dcp"), "the last part commits the set"
    assert "this rank's shards" in outcomes[0]["path"]
    info = ckpt.verify(tmp_path / "jit", 2)
    assert info.manifest.sharded and info.manifest.jit and info.manifest.world_size == 2
    assert sorted(info.manifest.files or {}) == [METADATA_FILE, "__0_0.distcp", "__1_0.distcp"]
    assert ckpt.iter_checkpoints(tmp_path / "jit") == [2]
    # Rank 0's part of step 99 alone was not committed; the next start removes it.
    assert (tmp_path / "alone").read_text() == "None"
    assert any(
        p.name.startswith(".ckpt-000000000099.dcp.tmp-") for p in (tmp_path / "jit").iterdir()
    )
    _run("jit-load", 3, tmp_path)  # resharded onto 3 ranks, through the manager
    loaded = [json.loads((tmp_path / f"jit-loaded-3-{rank}.json").read_text()) for rank in range(3)]
    assert all(r["resumed"] == 2 and r["model"] and r["cursor"] == 16 for r in loaded), loaded
    assert not any(p.name.startswith(".") for p in (tmp_path / "jit").iterdir())


def test_a_stop_signal_during_a_slow_periodic_save_leaves_the_live_state_alone(
    tmp_path: Path,
) -> None:
    """The step after a periodic save, slowed while its write is in flight, is no stall; a stall
    with no staged copy saves nothing from the monitor's thread (it would read FSDP2's live
    state while the training thread runs); no step is written twice."""
    _run("stop", 2, tmp_path)
    results = [json.loads((tmp_path / f"stop-{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert result["errors"] == [], result
        assert result["jit_writes"] == [] and result["exits"] == [], result
        assert not result["monitor_alive"], "the monitor gave up, leaving the graceful stop"
    assert ckpt.iter_checkpoints(tmp_path / "stop") == [2, 4]
    assert not ckpt.verify(tmp_path / "stop", 2).manifest.jit
    assert not any(p.name.startswith(".") for p in (tmp_path / "stop").iterdir())


def test_a_damaged_newest_checkpoint_falls_back_and_is_set_aside(
    saved: Path, tmp_path: Path
) -> None:
    directory = _copy(saved, tmp_path)
    shard = next((directory / "ckpt-000000000006.dcp").glob("__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"__1_.*\.distcp is corrupt: sha256"):
        ckpt.verify(directory, 6)
    info = ckpt.find_latest(directory)
    assert info is not None and info.step == 4
    ckpt.quarantine_newer_than(directory, info.step)
    assert (directory / "ckpt-000000000006.dcp.corrupt").is_dir()
    assert ckpt.iter_checkpoints(directory) == [4]


def test_missing_or_extra_files_and_an_uncommitted_directory_do_not_count(
    saved: Path, tmp_path: Path
) -> None:
    directory = _copy(saved, tmp_path)
    (directory / "ckpt-000000000006.dcp" / "stray").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="holds stray, which its manifest does not list"):
        ckpt.verify(directory, 6)
    (directory / "ckpt-000000000006.dcp" / "stray").unlink()
    (directory / "ckpt-000000000006.dcp" / METADATA_FILE).unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"lacks \.metadata"):
        ckpt.verify(directory, 6)
    # A directory renamed into place whose manifest was never written is not a checkpoint.
    (directory / "ckpt-000000000006.json").unlink()
    assert ckpt.iter_checkpoints(directory) == [4] and ckpt.find_latest(directory).step == 4  # type: ignore[union-attr]


def test_another_jobs_sharded_checkpoint_is_refused_in_one_line(saved: Path) -> None:
    info = ckpt.find_latest(saved / "ckpt")
    assert info is not None
    with pytest.raises(ckpt.CheckpointMismatchError) as caught:
        ckpt.check_fingerprint(info, {**FINGERPRINT, "seed": 1})
    assert "seed is 1 here but 0 in the checkpoint" in str(caught.value) and "\n" not in str(
        caught.value
    )


def test_a_replicated_model_refuses_a_sharded_checkpoint_in_one_line(
    saved: Path, tmp_path: Path
) -> None:
    """The format follows the model (``TrainingState.sharded``): a DDP job meeting a sharded
    checkpoint of the same job says so in one line instead of failing inside ``torch.load``."""
    from elastic_trainer.checkpoint.config import CheckpointConfig
    from elastic_trainer.checkpoint.manager import CheckpointManager
    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.runtime.settings import WorkerSettings

    directory = _copy(saved, tmp_path)
    model = torch.nn.Linear(16, 33)
    manager = CheckpointManager(
        CheckpointConfig(directory=str(directory)),
        env=read_env(environ={"RANK": "0", "WORLD_SIZE": "1"}, cuda_devices=0),
        states={"model": model},
        model=model,
        fingerprint=FINGERPRINT,
        settings=WorkerSettings(),
    )
    assert manager.state.sharded is None
    with pytest.raises(ckpt.CheckpointError) as caught:
        manager.load()
    message = str(caught.value)
    assert message.startswith(
        f"checkpoint {directory / 'ckpt-000000000006.dcp'} is sharded (FSDP2)"
    )
    assert "\n" not in message


def test_metadata_naming_code_is_refused(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    folder = tmp_path / "ckpt-000000000001.dcp"
    folder.mkdir()
    (folder / METADATA_FILE).write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="not allowed in a checkpoint's metadata"):
        read_metadata(folder)
    with pytest.raises(ckpt.CheckpointError, match="does not load"):
        sharded.read_full(folder)
    assert not (tmp_path / "pwned").exists()


def test_plain_data_entries_load_weights_only(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    dcp.save(
        {"w": torch.arange(4.0), "meta": {"step": 3, "name": "x"}},
        checkpoint_id=folder,
        no_dist=True,
    )
    loaded = sharded.read_full(folder)
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["meta"] == {
        "step": 3,
        "name": "x",
    }
    bad = tmp_path / "bad"
    dcp.save(
        {"w": torch.arange(4.0), "meta": {"when": ckpt.Manifest}}, checkpoint_id=bad, no_dist=True
    )
    with pytest.raises(ckpt.CheckpointError, match="does not load"):  # a class is not plain data
        sharded.read_full(bad)


def test_export_writes_one_plain_file(saved: Path, tmp_path: Path) -> None:
    info = ckpt.find_latest(saved / "ckpt")
    assert info is not None
    out = tmp_path / "out" / "model.pt"
    report = sharded.export(info, out)
    assert report["step"] == 6 and report["bytes"] == out.stat().st_size
    exported = torch.load(out, weights_only=True)
    reference = torch.load(saved / "ref-6.pt", weights_only=True)
    assert exported["step"] == 6 and exported["extra"] == {"epoch": 1}
    assert set(exported["model"]) == set(reference["model"])
    assert all(torch.equal(exported["model"][k], v) for k, v in reference["model"].items())
    # The exported model state loads into the plain (unsharded) model.
    plain = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 4))
    plain.load_state_dict(exported["model"])


def test_checkpoint_commands_understand_the_sharded_format(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastic_trainer.cli import main

    directory = _copy(saved, tmp_path)
    assert main(["checkpoint", "list", str(directory), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["format"], r["world_size"]) for r in rows] == [
        (4, "sharded", 2),
        (6, "sharded", 2),
    ]
    assert rows[-1]["path"].endswith("ckpt-000000000006.dcp")
    assert main(["checkpoint", "inspect", str(directory), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "sharded" and report["step"] == 6
    assert report["model_parameters"] == 16 * 33 + 33 + 33 * 4 + 4
    assert (
        report["entries"]["model"]["tensors"] == 4
        and report["entries"]["optimizer"]["tensors"] == 12
    )  # exp_avg, exp_avg_sq, step
    assert main(["checkpoint", "verify", str(directory)]) == 0
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "export", str(directory / "ckpt-000000000004.dcp"), str(out)]) == 0
    assert "exported step 4" in capsys.readouterr().out
    assert torch.equal(
        torch.load(out, weights_only=True)["model"]["2.bias"],
        torch.load(saved / "ref-4.pt", weights_only=True)["model"]["2.bias"],
    )
    # Damage: verify fails, export of the directory falls back to the newest good one.
    (directory / "ckpt-000000000006.dcp" / METADATA_FILE).write_bytes(b"garbage")
    assert main(["checkpoint", "verify", str(directory)]) == 1
    assert "BAD step          6" in capsys.readouterr().out
    assert main(["checkpoint", "export", str(directory), str(out)]) == 0
    assert torch.load(out, weights_only=True)["step"] == 4
    assert main(["checkpoint", "export", str(directory / "ckpt-000000000006.dcp"), str(out)]) == 2
    assert "is truncated or corrupt" in capsys.readouterr().err


def test_export_of_a_single_file_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastic_trainer.cli import main

    payload = {"format": ckpt.FORMAT, "model": {"w": torch.arange(3.0)}, "step": 7, "epoch": 0}
    ckpt.save_checkpoint(
        tmp_path / "ckpt",
        payload,
        step=7,
        epoch=0,
        world_size=2,
        fingerprint_fields={"seed": 0},
        keep_last=None,
    )
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "out.pt")]) == 0
    exported = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(exported["model"]["w"], torch.arange(3.0)) and exported["step"] == 7
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))


def test_a_save_in_this_process_writes_without_a_collective_or_a_warning(tmp_path: Path) -> None:
    """The just-in-time write of the shards a rank holds (no group, no collective): a checkpoint
    DCP reads back, and no 'assuming the intent is to save in a single process' warning, with no
    warnings filter (the filter list is process-wide; the save runs beside the training thread)."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from elastic_trainer.checkpoint.dcp_io import save_in_this_process
    from elastic_trainer.runtime import torch_compat

    state = {"w": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(7)}
    filters_before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        save_in_this_process(
            state, storage_writer=FileSystemWriter(tmp_path, sync_files=False, overwrite=True)
        )
    assert not [w for w in seen if "single process" in str(w.message)], [
        str(w.message) for w in seen
    ]
    assert warnings.filters == filters_before
    loaded = {"w": torch.empty(2, 3), "step": torch.tensor(0)}
    torch_compat.dcp_load_whole(loaded, storage_reader=FileSystemReader(tmp_path), planner=None)
    assert torch.equal(loaded["w"], state["w"]) and int(loaded["step"]) == 7


def test_parts_commit_while_a_slower_writer_of_a_part_still_writes(tmp_path: Path) -> None:
    """Just-in-time parts: rank 1's part is in (written by its neighbour from the copy) while rank
    1 itself still writes the same part into its temporary directory. The rank that completed the
    set commits anyway (before: removing that directory under the writer failed with 'Directory
    not empty', the step's checkpoint was never committed and the restart redid it; CI, 03:46)."""
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    from elastic_trainer.checkpoint.dcp_io import save_in_this_process

    folder = sharded.jit_path(tmp_path, 5, 7)
    folder.mkdir(parents=True)
    for rank in range(2):
        save_in_this_process(
            {"w": torch.arange(4.0)},
            storage_writer=FileSystemWriter(folder / f"rank-{rank}", sync_files=False),
        )
        (folder / f"rank-{rank}.done").write_text("{}")
    straggler = folder / ".rank-1.tmp-1-4242"
    stop = threading.Event()

    def write_on() -> None:
        n = 0
        while not stop.is_set():
            with contextlib.suppress(OSError):  # its directory may be gone: the writer fails then
                straggler.mkdir(exist_ok=True)
                (straggler / f"__0_{n}.distcp").write_bytes(b"x" * 4096)
            n += 1

    writer = threading.Thread(target=write_on)
    writer.start()
    try:
        info = sharded.commit_parts(
            tmp_path, folder, step=5, epoch=0, world_size=2, fingerprint_fields={}
        )
    finally:
        stop.set()
        writer.join(10)
    assert info is not None and info.step == 5
    assert ckpt.verify(tmp_path, 5).step == 5
    assert torch.equal(sharded.read_full(info.path)["w"], torch.arange(4.0))
