"""A worker SIGKILLed at a random step mid-epoch, just-in-time saving off: torchrun restarts the
group, every rank resumes from rank 0's last periodic checkpoint and replays the same batches,
and the final weights are bitwise equal to an uninterrupted run with the same seed and world
size."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from elastic_trainer.sample_log import committed_history, read_records
from tests.runtime_helpers import agents, final_model, start_agent, steps_recorded, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

DATASET, BATCH, EPOCHS = 600, 24, 2  # 25 steps per epoch, 50 in all
STEPS_PER_EPOCH = DATASET // BATCH


def _job(tmp: Path, name: str) -> list[str]:
    return ["--dataset-size", str(DATASET), "--global-batch-size", str(BATCH), "--epochs", str(EPOCHS),
            "--checkpoint-dir", str(tmp / name / "ckpt"), "--checkpoint-every", "4", "--seed", "11",
            "--record-samples", str(tmp / name / "samples"), "--throttle-ms", "40", "--log-every", "5"]


def test_sigkilled_worker_resumes_to_bitwise_equal_weights(etcd_server, unique_id: str, tmp_path: Path) -> None:
    kill_after = random.Random().randint(STEPS_PER_EPOCH + 2, 2 * STEPS_PER_EPOCH - 4)  # mid epoch 1
    print(f"killing a worker once step {kill_after} is recorded")
    with agents() as started:
        reference = start_agent(endpoint=etcd_server.endpoint, run_id=f"{unique_id}-ref", max_restarts=0,
                                log_path=tmp_path / "reference.log", job_args=_job(tmp_path, "reference"))
        # JIT off: this test is about the periodic checkpoint (JIT is test_runtime_jit_save.py).
        faulty = start_agent(endpoint=etcd_server.endpoint, run_id=f"{unique_id}-kill", max_restarts=2,
                             log_path=tmp_path / "faulty.log", job_args=_job(tmp_path, "faulty"),
                             extra_env={"ELASTIC_TRAINER_JIT_SAVE": "0"})
        started += [reference, faulty]
        wait_for(lambda: steps_recorded(tmp_path / "faulty" / "samples") >= kill_after, timeout=120,
                 what=f"step {kill_after}", agents=started)
        killed_pid = faulty.kill_worker(index=random.Random().randint(0, 1))
        print(f"SIGKILLed worker {killed_pid}")
        assert faulty.wait(180) == 0, faulty.tail()
        assert reference.wait(180) == 0, reference.tail()

    log = faulty.output()
    assert "resumed from" in log, log
    records = read_records(tmp_path / "faulty" / "samples")
    generations = {r[0]["generation"] for r in records}
    assert len(generations) == 2, "the group was restarted exactly once"
    resumed = max(r[0]["resumed_step"] for r in records)
    assert resumed % 4 == 0 and STEPS_PER_EPOCH < resumed < 2 * STEPS_PER_EPOCH, resumed  # a mid-epoch checkpoint

    ref_step, ref_model = final_model(tmp_path / "reference" / "ckpt")
    step, model = final_model(tmp_path / "faulty" / "ckpt")
    assert step == ref_step == EPOCHS * STEPS_PER_EPOCH
    assert model.keys() == ref_model.keys()
    for name in model:
        assert torch.equal(model[name], ref_model[name]), f"{name} differs after the restart"

    history = committed_history(records)
    assert sorted(history) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    for epoch in range(EPOCHS):
        indices = [i for s, recs in history.items() for r in recs if r["epoch"] == epoch for i in r["indices"]]
        assert sorted(indices) == list(range(DATASET)), f"epoch {epoch}: not every sample exactly once"
