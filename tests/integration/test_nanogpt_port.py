"""A nanoGPT-shaped script (docs/nanogpt/train.py: per-rank gradient accumulation, its own
``iter_num`` driving a hand-written learning-rate schedule, random-offset batches from a memmap,
``master_process``, its own checkpoint) ported to ``Elastic`` by docs/own-loop.md
(docs/nanogpt/train_elastic.py), with a worker SIGKILLed under ``elastic-trainer run``: it heals
in place and ends bitwise equal to an undisturbed run. The port that keeps its own counter instead
of ``step.number`` and logs after ``with step:`` is named where it goes wrong: the replacement's
learning rate (one line naming ``iter_num``), the code that ran for the failed attempt (one line),
and the replicas that then differ (the job stops, exit 2); under plain torchrun, which restarts
the group, the resumed counter's learning rate is named once (issue 40)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_trainer.ops.processes import NodeProcess, start_process, wait_for
from tests.support.agents import FAST_RDZV_CONF, start_agent
from tests.support.records import final_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
NANOGPT = REPO / "docs" / "nanogpt"
ITERS = 120

OWN_COUNTER = ("    iter_num, master_process = step.number - 1, elastic.env.is_rank0\n",
               "    master_process = elastic.env.is_rank0\n")  # fmt: skip
LOG_BLOCK = """        if iter_num % log_interval == 0 and master_process:
            lossf = loss.item()
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
        local_iter_num += 1
"""
LOG_AFTER_WITH = """    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item()
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
    local_iter_num += 1
    iter_num += 1
"""


RANDINT = "    ix = torch.randint(len(data) - block_size, (batch_size,))\n"
PER_RANK_GENERATOR = (
    "    ix = torch.randint(len(data) - block_size, (batch_size,), generator=offsets)\n"
)


def _script(tmp: Path, *, own_counter: bool = False, per_rank_generator: bool = False) -> Path:
    """The port as the guide writes it, or with nanoGPT's own counter kept and its log block
    after ``with step:`` (the two mistakes of the issue), or drawing its offsets from a generator
    of its own seeded by rank, beside a copy of its model module."""
    folder = tmp / ("own" if own_counter else "rank-gen" if per_rank_generator else "port")
    folder.mkdir()
    shutil.copy(NANOGPT / "gpt.py", folder)
    text = (NANOGPT / "train_elastic.py").read_text()
    if own_counter:
        assert text.count(OWN_COUNTER[0]) == 1 and text.count(LOG_BLOCK) == 1
        text = text.replace(OWN_COUNTER[0], OWN_COUNTER[1]).replace(LOG_BLOCK, LOG_AFTER_WITH)
    if per_rank_generator:
        assert text.count(RANDINT) == 1
        text = text.replace(RANDINT, PER_RANK_GENERATOR).replace(
            "\n\ndef get_batch(split):",
            '\noffsets = torch.Generator().manual_seed(1337 + int(os.environ["RANK"]))\n\n\n'
            "def get_batch(split):",
        )
    (folder / "train.py").write_text(text)
    return folder


def _env(tmp: Path, name: str) -> dict[str, str]:
    return {
        "OUT_DIR": str(tmp / name / "out"),
        "DATA_DIR": str(tmp / "data"),
        "MAX_ITERS": str(ITERS),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


def _run(tmp: Path, name: str, folder: Path, endpoint: str, run_id: str) -> NodeProcess:
    command = [
        sys.executable, "-m", "elastic_trainer.cli", "run", "--rdzv-endpoint", endpoint,
        "--run-id", run_id, "--nnodes", "1", "--nproc-per-node", "2", "--metrics-port", "0",
        "--rdzv-conf", FAST_RDZV_CONF, "train.py",
    ]  # fmt: skip
    return start_process(
        command, tmp / f"{name}.log", {**os.environ, **_env(tmp, name)}, cwd=folder
    )


def _iteration_logged(node: NodeProcess, number: int) -> bool:
    return f"iter {number}:" in node.log_path.read_text(errors="replace")


def _prepared(tmp: Path) -> None:
    """The memmaps, written once before the runs race to write them."""
    subprocess.run(
        [sys.executable, "-c", f"from gpt import prepare; prepare({str(tmp / 'data')!r})"],
        cwd=NANOGPT, check=True, timeout=60,
    )  # fmt: skip


def _killed_once_under_torchrun(endpoint: str, run_id: str, tmp: Path, folder: Path) -> str:
    """The script under plain torchrun, a worker SIGKILLed at iteration 40 (torchrun restarts the
    group from the just-in-time checkpoint); the job must end well. Its log."""
    node = start_agent(
        endpoint=endpoint, run_id=run_id, log_path=tmp / "torchrun.log", job_args=[],
        target=[str(folder / "train.py")], extra_env=_env(tmp, "torchrun"),
    )  # fmt: skip
    with node:
        wait_for(lambda: _iteration_logged(node, 40), timeout=180, what="iteration 40")
        node.kill_worker(1)
        assert node.proc.wait(240) == 0, node.log_path.read_text()[-3000:]
    return node.log_path.read_text()


def test_the_ported_script_heals_a_sigkill_bitwise(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    _prepared(tmp_path)
    folder = _script(tmp_path, own_counter=False)
    with (
        _run(tmp_path, "ref", folder, etcd_server.endpoint, f"{unique_id}-ref") as reference,
        _run(tmp_path, "faulty", folder, etcd_server.endpoint, unique_id) as faulty,
    ):
        wait_for(lambda: _iteration_logged(faulty, 40), timeout=180, what="iteration 40")
        faulty.kill_worker(1)
        assert faulty.proc.wait(240) == 0, faulty.log_path.read_text()[-3000:]
        assert reference.proc.wait(240) == 0, reference.log_path.read_text()[-3000:]
    log = faulty.log_path.read_text()
    assert "healed in place" in log, log[-3000:]
    for mistake in ("learning rate went from", "ran for the failed attempt", "replicas'"):
        assert mistake not in log, log[-3000:]
    step, model = final_model(tmp_path / "faulty" / "out" / "elastic")
    ref_step, expected = final_model(tmp_path / "ref" / "out" / "elastic")
    assert step == ref_step == ITERS + 1
    assert model.keys() == expected.keys()
    for name in model:
        assert torch.equal(model[name], expected[name]), f"{name} differs"


def test_an_own_counter_and_a_log_after_the_step_are_named_and_the_job_stops(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    _prepared(tmp_path)
    folder = _script(tmp_path, own_counter=True)
    with _run(tmp_path, "own", folder, etcd_server.endpoint, unique_id) as node:
        wait_for(lambda: _iteration_logged(node, 40), timeout=180, what="iteration 40")
        node.kill_worker(1)
        code = node.proc.wait(240)
    log = node.log_path.read_text()
    assert code == 2, log[-3000:]  # the replicas differ: no restart can fix it
    rates = [line for line in log.splitlines() if "the learning rate went from" in line]
    assert len(rates) == 1 and "(likely iter_num or local_iter_num)" in rates[0], log[-4000:]
    after = [line for line in log.splitlines() if "ran for the failed attempt" in line]
    assert len(after) == 1 and "train.py:" in after[0], log[-4000:]
    differ = [line for line in log.splitlines() if "replicas' parameters" in line]
    assert differ and all("own step counter" in line for line in differ), log[-4000:]


def test_under_plain_torchrun_a_resumed_own_counter_is_named_once(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    _prepared(tmp_path)
    folder = _script(tmp_path, own_counter=True)
    log = _killed_once_under_torchrun(etcd_server.endpoint, unique_id, tmp_path, folder)
    rates = [line for line in log.splitlines() if "the learning rate went from" in line]
    assert len(rates) == 1 and "likely iter_num" in rates[0], log[-4000:]


def test_a_per_rank_generator_is_named_at_the_start_and_the_replicas_stay_alike(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    """Offsets from a generator of the script's own, seeded by rank and never saved: a heal
    restarts it in the replacement (the run is then not the undisturbed one), which one line at
    the start names with its fix; the replicas stay alike (DDP averages), so the job ends."""
    _prepared(tmp_path)
    folder = _script(tmp_path, per_rank_generator=True)
    with _run(tmp_path, "gen", folder, etcd_server.endpoint, unique_id) as node:
        wait_for(lambda: _iteration_logged(node, 40), timeout=180, what="iteration 40")
        # Rank 1's process (rank 0 warned at the start; its replacement would start again).
        pid = re.search(r"rank 1/2 \(local \d+, pid (\d+)\)", node.log_path.read_text())
        assert pid is not None, node.log_path.read_text()[-3000:]
        os.kill(int(pid.group(1)), signal.SIGKILL)
        code = node.proc.wait(240)
    log = node.log_path.read_text()
    assert code == 0, log[-3000:]
    named = [line for line in log.splitlines() if "not saved, yet changed in training" in line]
    assert len(named) == 1 and "offsets (Generator)" in named[0], log[-4000:]
    assert "offsets.manual_seed(torch.initial_seed() + 1) each step" in named[0]
    assert "replicas' parameters" not in log and "healed in place" in log


def test_under_plain_torchrun_a_per_rank_generator_is_named_once_an_attempt(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    """The same generator under plain torchrun: a worker SIGKILL restarts the group from the
    just-in-time checkpoint (two attempts), each names the generator at most once, and the
    replicas stay alike."""
    _prepared(tmp_path)
    folder = _script(tmp_path, per_rank_generator=True)
    log = _killed_once_under_torchrun(etcd_server.endpoint, unique_id, tmp_path, folder)
    named = [line for line in log.splitlines() if "not saved, yet changed in training" in line]
    attempts = 1 + log.count("INFO elastic_trainer.checkpoint.manager: resumed from")
    assert attempts >= 2, log[-4000:]  # torchrun restarted the group
    assert len(named) == attempts, log[-4000:]  # once an attempt, by rank 0
    assert all("offsets (Generator)" in line for line in named), named
    assert "replicas' parameters" not in log, log[-4000:]
