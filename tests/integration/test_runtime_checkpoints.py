"""Checkpoints under real torchrun restarts: damaged newest checkpoints are skipped, a foreign
checkpoint directory is refused without being touched, and SIGTERM to an agent leaves a
checkpoint of exactly the step the workers stopped at."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch

from elastic_trainer.ops.processes import wait_for
from elastic_trainer.runtime.sample_log import read_records
from tests.support.agents import agents, start_agent, tails
from tests.support.records import final_model, steps_recorded

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _args(ckpt: Path, *extra: str) -> list[str]:
    return [
        "--dataset-size",
        "512",
        "--global-batch-size",
        "16",
        "--epochs",
        "3",
        "--seed",
        "5",
        "--checkpoint-dir",
        str(ckpt),
        "--log-every",
        "4",
        *extra,
    ]


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_damaged_newest_checkpoints_resume_from_the_previous_good_one(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    with agents() as started:
        first = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=f"{unique_id}-1",
            log_path=tmp_path / "first.log",
            job_args=_args(ckpt, "--max-steps", "12", "--checkpoint-every", "4"),
        )
        started.append(first)
        assert first.wait(120) == 0, first.tail()
        newest, second_newest = ckpt / "ckpt-000000000012.pt", ckpt / "ckpt-000000000008.pt"
        with open(newest, "r+b") as f:  # truncated: a write cut short
            f.truncate(newest.stat().st_size // 3)
        data = bytearray(second_newest.read_bytes())  # corrupt: same size, one byte flipped
        data[len(data) // 2] ^= 0x5A
        second_newest.write_bytes(bytes(data))

        second = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=f"{unique_id}-2",
            log_path=tmp_path / "second.log",
            job_args=_args(ckpt, "--max-steps", "16", "--checkpoint-every", "4"),
        )
        started.append(second)
        assert second.wait(120) == 0, second.tail()
    log = second.output()
    assert f"skipping checkpoint: checkpoint {newest} is truncated or corrupt" in log
    assert f"skipping checkpoint: checkpoint {second_newest} is corrupt: sha256" in log
    assert f"resumed from {ckpt / 'ckpt-000000000004.pt'} (step 4" in log
    assert (ckpt / "ckpt-000000000012.pt.corrupt").exists() and (
        ckpt / "ckpt-000000000008.pt.corrupt"
    ).exists()
    step, _ = final_model(ckpt)
    assert step == 16


def test_foreign_checkpoint_is_a_clear_error_and_nothing_is_overwritten(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    with agents() as started:
        owner = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=f"{unique_id}-1",
            log_path=tmp_path / "owner.log",
            job_args=_args(ckpt, "--max-steps", "3", "--width", "8"),
        )
        started.append(owner)
        assert owner.wait(120) == 0, owner.tail()
        before = _digests(ckpt)
        intruder = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=f"{unique_id}-2",
            max_restarts=0,
            log_path=tmp_path / "intruder.log",
            job_args=_args(ckpt, "--max-steps", "6", "--width", "16"),
        )
        started.append(intruder)
        assert intruder.wait(120) != 0
    log = intruder.output()
    error_lines = [
        line for line in log.splitlines() if line.startswith("synthetic_cnn: error: checkpoint")
    ]
    assert error_lines, log
    assert (
        "belongs to a different job (model tensor 'features.0.weight' is float32[16, 3, 3, 3] here but "
        "float32[8, 3, 3, 3] in the checkpoint)" in error_lines[0]
    )
    assert "Nothing was overwritten" in error_lines[0]
    worker_tracebacks = [
        line for line in log.splitlines() if line.startswith("[rank") and "Traceback" in line
    ]
    assert not worker_tracebacks, "a clear one-line error, not a traceback"
    assert _digests(ckpt) == before


def test_sigterm_to_an_agent_checkpoints_the_step_it_stopped_at(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    ckpt, samples = tmp_path / "ckpt", tmp_path / "samples"
    with agents() as started:
        agent = start_agent(
            endpoint=etcd_server.endpoint,
            run_id=unique_id,
            log_path=tmp_path / "agent.log",
            job_args=_args(
                ckpt,
                "--max-steps",
                "10000",
                "--checkpoint-every",
                "1000",
                "--throttle-ms",
                "30",
                "--record-samples",
                str(samples),
            ),
            extra_env={"ELASTIC_TRAINER_SIGTERM_GRACE_S": "20"},
        )
        started.append(agent)
        wait_for(
            lambda: steps_recorded(samples) >= 7,
            timeout=120,
            what="step 7",
            describe=lambda: tails(started),
        )
        signalled = time.monotonic()
        agent.terminate()
        agent.wait(60)
        took = time.monotonic() - signalled
    log = agent.output()
    last_steps = {
        max(r["step"] for r in records if r["event"] == "done") for records in read_records(samples)
    }
    assert len(last_steps) == 1, f"ranks stopped after different steps: {last_steps}"
    stopped_at = last_steps.pop()
    assert stopped_at < 1000
    step, model = final_model(ckpt)
    assert step == stopped_at, log
    assert sorted(p.name for p in ckpt.glob("*.pt")) == [f"ckpt-{stopped_at:012d}.pt"]
    assert f"stopping after step {stopped_at}" in log and "stopped_by_signal True" in log
    assert "received SIGTERM" in log
    assert took < 20 + 5, f"workers took {took:.1f} s to stop"
    assert all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point())
