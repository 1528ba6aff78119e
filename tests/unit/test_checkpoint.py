"""Unit tests of checkpoint files: atomic writes, manifest, fallback, mismatch, device mapping."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.state.host_copy import snapshot_to_cpu

pytestmark = pytest.mark.timeout(120)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _fields(model: nn.Module, **extra: object) -> dict:
    return {"model": ckpt.model_signature(model.state_dict()), "seed": 0, **extra}


def _save(
    directory: Path, step: int, model: nn.Module | None = None, keep_last: int = 5
) -> ckpt.CheckpointInfo:
    model = model or _model()
    payload = {
        "format": ckpt.FORMAT,
        "model": model.state_dict(),
        "step": step,
        "extra": [1, 2.5, None, "x"],
    }
    return ckpt.save_checkpoint(
        directory,
        payload,
        step=step,
        epoch=0,
        world_size=2,
        fingerprint_fields=_fields(model),
        keep_last=keep_last,
    )


def test_plain_torch_load_gives_the_model_state_dict(tmp_path: Path) -> None:
    model = _model()
    info = _save(tmp_path, 7, model)
    state = torch.load(info.path, weights_only=True)
    assert state["step"] == 7
    fresh = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    fresh.load_state_dict(state["model"])
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_manifest_records_sha256_and_size(tmp_path: Path) -> None:
    info = _save(tmp_path, 3)
    manifest = json.loads(ckpt.manifest_path(tmp_path, 3).read_text())
    data = info.path.read_bytes()
    import hashlib

    assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    assert manifest["nbytes"] == len(data)
    assert manifest["step"] == 3 and manifest["world_size"] == 2
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_keeps_only_the_last_n(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        _save(tmp_path, step, keep_last=2)
    assert list(ckpt.iter_checkpoints(tmp_path)) == [30, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000000030.json",
        "ckpt-000000000030.pt",
        "ckpt-000000000040.json",
        "ckpt-000000000040.pt",
    ]


@pytest.mark.parametrize("damage", ["truncate", "flip", "drop_manifest", "garble_manifest"])
def test_damaged_newest_falls_back_to_previous_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    if damage == "truncate":
        with open(newest.path, "r+b") as f:
            f.truncate(newest.manifest.nbytes // 2)
    elif damage == "flip":
        data = bytearray(newest.path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        newest.path.write_bytes(bytes(data))
    elif damage == "drop_manifest":
        ckpt.manifest_path(tmp_path, 20).unlink()
    else:
        ckpt.manifest_path(tmp_path, 20).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="elastic_trainer.checkpoint.files"):
        found = ckpt.find_latest(tmp_path)
    assert found is not None and found.step == 10
    assert "ckpt-000000000020" in caplog.text
    ckpt.quarantine_newer_than(tmp_path, found.step)
    # Quarantined: later pruning can never pick the bad one over a good one.
    assert ckpt.checkpoint_path(tmp_path, 20).with_name("ckpt-000000000020.pt.corrupt").exists()
    _save(tmp_path, 30, keep_last=1)
    assert list(ckpt.iter_checkpoints(tmp_path)) == [30]


def test_no_checkpoint_is_none(tmp_path: Path) -> None:
    assert ckpt.find_latest(tmp_path / "missing") is None
    assert ckpt.find_latest(tmp_path) is None


def test_foreign_checkpoint_is_a_clear_error_naming_the_difference(tmp_path: Path) -> None:
    info = _save(tmp_path, 5)
    other = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))
    with pytest.raises(
        ckpt.CheckpointMismatchError,
        match=r"different job \(model tensor '0.weight' is float32\[16, 4\] here but float32\[8, 4\]",
    ):
        ckpt.check_fingerprint(info, _fields(other))
    with pytest.raises(
        ckpt.CheckpointMismatchError, match="seed is 1 here but 0 in the checkpoint"
    ):
        ckpt.check_fingerprint(info, {**_fields(_model()), "seed": 1})
    ckpt.check_fingerprint(info, _fields(_model()))  # same job: no error


_FULL_DISK_SCRIPT = textwrap.dedent(
    """
    import resource, signal, sys, torch
    from elastic_trainer.checkpoint import files as ckpt
    directory, limit = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        ckpt.save_checkpoint(directory, {"format": ckpt.FORMAT, "model": {"w": torch.ones(1 << 20)}},
                             step=99, epoch=0, world_size=1, fingerprint_fields={}, keep_last=1)
    except ckpt.CheckpointWriteError as exc:
        print(exc)
        sys.exit(3)
    """
)


def test_write_failure_is_clear_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    previous = _save(tmp_path, 10)
    before = previous.path.read_bytes()
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_SCRIPT, str(tmp_path), str(64 * 1024)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3, result.stderr
    message = result.stdout.strip()
    assert "could not write the checkpoint of step 99" in message
    assert "ckpt-000000000010.pt is untouched" in message
    assert "Traceback" not in result.stdout + result.stderr
    assert previous.path.read_bytes() == before
    assert ckpt.find_latest(tmp_path).step == 10
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or "000099" in p.name]


def test_load_never_unpickles_arbitrary_objects(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    torch.save({"format": ckpt.FORMAT, "model": {}, "x": Evil()}, path)
    with pytest.raises(ckpt.CheckpointError, match="does not load with weights_only=True"):
        ckpt.load_checkpoint(path, torch.device("cpu"))
    assert not marker.exists()


def test_load_rejects_a_file_of_another_format(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(ckpt.CheckpointError, match="is not an elastic-trainer/1 checkpoint"):
        ckpt.load_checkpoint(path, torch.device("cpu"))


def test_written_on_cuda_loaded_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint whose tensors are tagged ``cuda:1`` (as rank 1 on a GPU node writes them) loads
    on a CPU-only process with the runtime's map_location, onto the CPU."""
    model = _model()
    path = tmp_path / "gpu-written.pt"
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:1")
    torch.save({"format": ckpt.FORMAT, "model": model.state_dict()}, path)
    monkeypatch.undo()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)  # what a plain load does on this machine
    state = ckpt.load_checkpoint(path, torch.device("cpu"))
    assert {t.device.type for t in state["model"].values()} == {"cpu"}
    assert torch.equal(state["model"]["0.weight"], model.state_dict()["0.weight"])


def test_map_location_keeps_cpu_tensors_on_cpu(tmp_path: Path) -> None:
    path = tmp_path / "cpu.pt"
    torch.save(
        {"format": ckpt.FORMAT, "model": {"w": torch.ones(2)}, "rng": torch.get_rng_state()}, path
    )
    state = ckpt.load_checkpoint(path, torch.device("cpu"))
    assert state["rng"].device.type == "cpu" and state["model"]["w"].device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.parametrize("saved_on", ["cuda:0", "cuda:1", "cpu"])
def test_gpu_map_location_puts_tensors_on_own_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved_on: str
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (gpu marker)")
    own = torch.device(f"cuda:{torch.cuda.device_count() - 1}")
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    path = tmp_path / "ckpt.pt"
    if saved_on == "cuda:0":
        torch.save(
            {
                "format": ckpt.FORMAT,
                "model": {k: v.to("cuda:0") for k, v in weights.items()},
                "rng": torch.get_rng_state(),
            },
            path,
        )
    else:  # a tag of a device this machine may not have (rank 1 of a 2-GPU node), or CPU
        monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: saved_on)
        torch.save({"format": ckpt.FORMAT, "model": weights, "rng": torch.get_rng_state()}, path)
        monkeypatch.undo()
    state = ckpt.load_checkpoint(path, own)
    expected = own if saved_on.startswith("cuda") else torch.device("cpu")
    assert state["model"]["w"].device == expected
    assert torch.equal(state["model"]["w"].cpu(), weights["w"])
    cpu_state = ckpt.load_checkpoint(path, torch.device("cpu"))
    assert cpu_state["model"]["w"].device.type == "cpu"


def test_snapshot_is_a_deep_cpu_copy() -> None:
    original = {"a": torch.ones(3), "b": [torch.zeros(2), (torch.ones(1), 5)], "c": "x"}
    snap = snapshot_to_cpu(original)
    original["a"].add_(1)
    original["b"][0].add_(1)
    assert torch.equal(snap["a"], torch.ones(3)) and torch.equal(snap["b"][0], torch.zeros(2))
    assert snap["b"][1][1] == 5 and snap["c"] == "x"


def test_async_writer_runs_one_write_at_a_time_and_reports_errors(tmp_path: Path) -> None:
    writer = ckpt.AsyncCheckpointWriter()
    release = threading.Event()
    running = []

    def slow_save() -> ckpt.CheckpointInfo:
        running.append(1)
        release.wait(10)
        return _save(tmp_path, 1)

    writer.submit(slow_save)
    assert writer.busy
    submitted = threading.Event()

    def second() -> None:
        writer.submit(lambda: _save(tmp_path, 2))
        submitted.set()

    t = threading.Thread(target=second)
    t.start()
    assert not submitted.wait(0.2)  # blocked behind the write in flight
    release.set()
    t.join(10)
    assert writer.wait(10).step == 2 and len(running) == 1

    def failing() -> ckpt.CheckpointInfo:
        raise OSError(28, "No space left on device")

    writer.submit(failing)
    with pytest.raises(ckpt.CheckpointWriteError, match="background checkpoint write failed"):
        writer.wait(10)
    assert writer.wait(10) is not None  # the error is reported once


def test_stale_temp_files_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".ckpt-000000000005.pt.tmp-1234"
    stale.write_bytes(b"partial")
    keep = tmp_path / "notes.txt"
    keep.write_text("user file")
    ckpt.remove_stale_temp_files(tmp_path)
    assert not stale.exists() and keep.exists()


def test_pickle_of_python_rng_state_loads_weights_only(tmp_path: Path) -> None:
    from elastic_trainer.runtime import rng

    state = rng.capture(torch.device("cpu"))
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    import random

    expected = [random.random() for _ in range(3)], torch.rand(3)
    rng.restore(loaded, torch.device("cpu"))
    assert [random.random() for _ in range(3)] == expected[0]
    assert torch.equal(torch.rand(3), expected[1])
    assert pickle.dumps(loaded["python"])  # plain data


def test_a_refused_commit_leaves_the_directory_as_it_was(tmp_path: Path) -> None:
    """The fence is asked after the data is written and before anything is renamed: a writer cut
    off from its job neither adds a checkpoint nor replaces one of the same step."""
    kept = _save(tmp_path, 5)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    asked: list[bool] = []

    def fence() -> str | None:
        asked.append(
            any(".tmp-" in p.name for p in tmp_path.iterdir())
        )  # the data is written by now
        return "etcd did not confirm that this process still belongs to the job"

    other = _model()
    with torch.no_grad():
        other[0].weight.add_(1.0)
    payload = {"format": ckpt.FORMAT, "model": other.state_dict(), "step": 5}
    for step in (5, 6):
        with pytest.raises(
            ckpt.CheckpointFencedError, match=f"step {step} was not committed: etcd did not confirm"
        ):
            ckpt.save_checkpoint(
                tmp_path,
                payload,
                step=step,
                epoch=0,
                world_size=2,
                fingerprint_fields=_fields(other),
                keep_last=5,
                fence=fence,
            )
    assert asked == [True, True]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert ckpt.verify(tmp_path, 5).manifest.sha256 == kept.manifest.sha256

    info = ckpt.save_checkpoint(
        tmp_path,
        payload,
        step=6,
        epoch=0,
        world_size=2,
        fingerprint_fields=_fields(other),
        keep_last=5,
        fence=lambda: None,
    )
    assert ckpt.iter_checkpoints(tmp_path) == [5, 6] and info.manifest.step == 6


def test_a_fenced_background_write_is_skipped_not_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer = ckpt.AsyncCheckpointWriter()
    writer.submit(lambda: _save(tmp_path, 1))
    assert writer.wait(10) is not None

    def fenced() -> ckpt.CheckpointInfo:
        raise ckpt.CheckpointFencedError(
            "the checkpoint of step 2 was not committed: the job went on without it"
        )

    caplog.set_level(logging.WARNING, logger="elastic_trainer.checkpoint.files")
    writer.submit(fenced)
    result = writer.wait(10)  # no error: training goes on, the next checkpoint tries again
    assert result is not None and result.manifest.step == 1
    assert not writer.failed and "step 2 was not committed" in caplog.text


def test_a_failed_sharded_write_is_one_line(tmp_path: Path) -> None:
    """DCP's CheckpointException carries every failed rank's traceback in its text; the write
    error (and the close-time log of a background write a dead peer cut) names each rank's error
    in one line instead."""
    from torch.distributed.checkpoint import CheckpointException

    cut = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer\nmore")
    failure = CheckpointException("save failed", {1: (cut, None), 0: (ValueError("x"), None)})
    assert "\n" in str(failure)
    error = ckpt.write_error(tmp_path, 5, failure)
    assert "\n" not in str(error)
    assert (
        "rank 0: ValueError: x; rank 1: RuntimeError: [../gloo/transport/tcp/pair.cc:534] "
        in str(error)
    )
    assert "\n" not in str(ckpt.write_error(tmp_path, 5, cut))
