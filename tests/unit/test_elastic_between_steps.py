"""What an own loop's body sees between steps (after ``with step:``): the global mean loss the
progress line prints (``Elastic.reported_loss``, two real gloo processes), and, under plain
torchrun, an uncaught peer failure of its own collective told in one line (the
``sys.excepthook`` of ``one_line_for_uncaught_failures``, in a real interpreter). The same failure in a
real torchrun job: ``tests/integration/test_own_loop.py``."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_trainer import Elastic
from tests.support.dist_env import cpu_env

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
STEPS = 5
GLOBAL_BATCH = 8


# -- the reported loss ------------------------------------------------------------------------------
def _loss_worker(rank: int, store_path: str, results: Any) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
        elastic = Elastic(
            model,
            len(data),
            global_batch_size=GLOBAL_BATCH,
            micro_batch_size=2,  # two micro-batches a rank: weights of 2 x 2 / 8
            max_steps=STEPS,
            log_every=1000,
            env=cpu_env(rank, 2),
        )
        sums: dict[int, float] = {}  # this rank's sum of per-sample losses, by step
        seen: dict[int, tuple[int, float] | None] = {}
        for step in elastic:
            with step:
                total = 0.0
                for micro in step:
                    per_sample = elastic.ddp(data[list(micro.indices)]).square().squeeze(1)
                    step.backward(per_sample.mean() * step.weight)
                    total += float(per_sample.sum())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            sums[step.number] = total
            seen[step.number] = elastic.reported_loss  # between steps, as a logger would
        assert elastic.result is not None
        results.put((rank, sums, seen, elastic.reported_loss, elastic.result.loss))
    finally:
        dist.destroy_process_group()


def test_reported_loss_is_the_global_mean_loss_of_a_named_step_alike_on_every_rank(
    tmp_path: Path,
) -> None:
    """``loss * step.weight`` carries the world-size share (a rank's sum of it is not the mean
    loss); ``elastic.reported_loss`` is the mean over the global batch, the progress line's value,
    with the step it belongs to: a step or two late during the run, the last step after it."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [
        context.Process(target=_loss_worker, args=(rank, str(tmp_path / "store"), results))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        got = {rank: rest for rank, *rest in (results.get(timeout=100) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(30)
    sums0, seen0, final0, result_loss = got[0]
    sums1, seen1, final1, _ = got[1]
    mean = {n: (sums0[n] + sums1[n]) / GLOBAL_BATCH for n in sums0}
    assert seen0 == seen1 and final0 == final1, "alike on every rank"
    assert final0 is not None and final0[0] == STEPS
    assert final0[1] == pytest.approx(mean[STEPS], rel=1e-5) == result_loss
    during = [(n, value) for n, value in seen0.items() if value is not None]
    assert during, f"losses arrive during the run: {seen0}"
    for number, (step, loss) in during:
        assert step < number, "a later step's control carries it"
        assert loss == pytest.approx(mean[step], rel=1e-5), (step, loss, mean)


def test_reported_loss_is_none_before_the_first_and_read_only() -> None:
    elastic = Elastic(nn.Linear(3, 1), 8, global_batch_size=4, max_steps=1, env=cpu_env())
    assert elastic.reported_loss is None
    with pytest.raises(AttributeError):
        elastic.reported_loss = (1, 0.0)  # type: ignore[misc]


# -- an uncaught peer failure under plain torchrun ----------------------------------------------------
_RAISES = """
import sys

from elastic_trainer.runtime.failures import DeterministicError
from elastic_trainer.train.elastic import one_line_for_uncaught_failures


def mine(kind, exc, tb):
    print(f"previous hook: {kind.__name__}", file=sys.stderr)


if sys.argv[1] == "chained":
    sys.excepthook = mine
one_line_for_uncaught_failures(peer_failures=sys.argv[1] != "alone")
one_line_for_uncaught_failures(peer_failures=False)  # once per process; what it covers stays
if sys.argv[1] == "mistake":
    raise DeterministicError("checkpoint ckpt/ckpt-000000000300.pt belongs to a different job")
if sys.argv[1] in ("peer", "alone"):
    raise RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:60060. This is typically caused by a remote worker crashing. GLHF!"
    )
raise ValueError("a bug of mine")
"""


def _raise(tmp_path: Path, what: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "raises.py").write_text(_RAISES)
    env = {
        **os.environ,
        "RANK": "1",
        "TORCHELASTIC_ERROR_FILE": str(tmp_path / f"error-{what}.json"),
        "PYTHONPATH": str(REPO),
    }
    env.pop("ELASTIC_TRAINER_REPORTS_FAILURES", None)
    return subprocess.run(
        [sys.executable, str(tmp_path / "raises.py"), what],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_uncaught_peer_failure_is_one_line_recorded_for_torchrun_and_exit_1(
    tmp_path: Path,
) -> None:
    peer = _raise(tmp_path, "peer")
    assert peer.returncode == 1
    assert peer.stderr == (
        "elastic_trainer: a collective failed (a peer died or timed out): Connection closed by "
        "peer [127.0.0.1]:60060 (rank 1); stopping for a restart\n"
    ), peer.stderr
    error = json.loads((tmp_path / "error-peer.json").read_text())
    assert error["errorTraits"]["category"] == "transient", error

    bug = _raise(tmp_path, "bug")  # anything else: the usual traceback
    assert bug.returncode == 1
    assert "Traceback" in bug.stderr and "ValueError: a bug of mine" in bug.stderr, bug.stderr
    assert not (tmp_path / "error-bug.json").exists()

    chained = _raise(tmp_path, "chained")
    assert chained.stderr.strip() == "previous hook: ValueError", chained.stderr

    alone = _raise(tmp_path, "alone")  # not under plain torchrun: gloo's traceback stays
    assert alone.returncode == 1 and "Traceback" in alone.stderr, alone.stderr


def test_an_uncaught_mistake_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A mistake no restart can fix that reaches a program passing group= and is not caught
    there (the FSDP2 recipe): one line, exit status 2, as without group= (a new user's trial:
    a CheckpointMismatchError traceback per rank before)."""
    mistake = _raise(tmp_path, "mistake")
    assert mistake.returncode == 2, mistake.stderr
    assert mistake.stderr == (
        "elastic_trainer: error: checkpoint ckpt/ckpt-000000000300.pt belongs to a different job "
        "(rank 1)\n"
    ), mistake.stderr
