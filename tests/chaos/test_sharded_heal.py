"""Sharded (FSDP2 / HSDP) state healed in place under ``elastic-trainer run``, on ``sharded_lm``.

FSDP, 3 workers: rank 1 SIGKILLed mid-run is healed in place (the survivors keep their
processes; rank 1's shard comes from rank 0's neighbour copy, 0 steps redone); later ranks 1 and
2 SIGKILLed together (rank 2's shard and its only copy, on rank 1, are gone) fall back to the
newest checkpoint, resharded, with the redone steps counted in one line. HSDP, a 2 x 2 mesh: rank
1 SIGKILLed, its shard comes from its replica (rank 3). Both cases run on both routes of
``sharded_lm``: its own loop on ``Elastic(group=, rebuild=)`` (``--api loop``), and the
``Trainer`` (``--api trainer``: ``TrainerConfig.fsdp``, or for HSDP a model factory that shards
over the 2-D mesh itself); both build and shard the model again on the healed group. Each faulty run ends bitwise equal
(model and AdamW state) to a fault-free run of the same shape started beside it, and every
sample of every epoch is trained exactly once. Heal times are printed, not asserted (a loaded
2-core machine). Design: ``docs/design/sharded.md``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from elastic_trainer.ops.processes import start_process, wait_for
from elastic_trainer.runtime.sample_log import committed_history, generations, read_records
from tests.support.agents import FAST_RDZV_CONF, Agent, agents, kill_rank, tails
from tests.support.records import final_sharded_state, steps_recorded

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
DATASET, BATCH, STEPS = 120, 12, 22  # 10 steps per epoch


def _start(endpoint: str, run_id: str, run: Path, workers: int, extra: Sequence[str] = ()) -> Agent:
    run.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "elastic_trainer.cli", "run", "--rdzv-endpoint", endpoint,
        "--run-id", run_id, "--nnodes", "1", "--nproc-per-node", str(workers),
        "--metrics-port", "0", "--rdzv-conf", FAST_RDZV_CONF,
        "-m", "elastic_trainer.examples.sharded_lm", "--max-steps", str(STEPS), "--epochs", "5",
        "--dataset-size", str(DATASET), "--global-batch-size", str(BATCH),
        "--checkpoint-every", "5", "--checkpoint-dir", str(run / "ckpt"), "--seed", "5",
        "--record-samples", str(run / "samples"), "--log-every", "100", "--throttle-ms", "250",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return start_process(cmd, run / "run.log", env, cwd=REPO)


def _wait_step(run: Path, step: int, started: list[Agent]) -> None:
    wait_for(
        lambda: steps_recorded(run / "samples") >= step,
        timeout=150,
        what=f"step {step}",
        describe=lambda: tails(started),
    )


def _all_done(run: Path, step: int, world: int) -> bool:
    """Every rank of the newest generation completed ``step`` (and so sent its copy of it)."""
    processes = read_records(run / "samples")
    if not processes:
        return False
    newest = max(records[0]["started_unix"] for records in processes)
    done = {
        records[0]["rank"]
        for records in processes
        if records[0]["started_unix"] == newest
        and any(r["event"] == "done" and r["step"] >= step for r in records)
    }
    return len(done) == world


def _wait_between_steps(run: Path, step: int, world: int, started: list[Agent]) -> None:
    """Until every rank completed ``step``: a kill now lands in the pause before the next step
    (``--throttle-ms``), after the copy of ``step`` was sent and before any rank can complete
    another (a kill in the middle of a step's collectives can let some survivors finish it and
    not others: then every rank goes back a step, 1 step redone, which the unit tests cover)."""
    wait_for(
        lambda: _all_done(run, step, world),
        timeout=150,
        interval=0.01,
        what=f"every rank at step {step}",
        describe=lambda: tails(started),
    )
    # The copy of ``step`` is exchanged on a background thread that starts as the step is recorded
    # done: a kill within its few milliseconds cuts it, and the heal rightly goes back one step
    # (the test then checks that accounting). 0.1 s lets it land, well inside the 0.25 s pause.
    time.sleep(0.1)


def _check_exact(reference: Path, faulty: Path) -> None:
    """Bitwise equal to the fault-free run; every sample of every epoch exactly once."""
    expected, got = final_sharded_state(reference / "ckpt"), final_sharded_state(faulty / "ckpt")
    assert int(got["step"]) == int(expected["step"]) == STEPS
    assert got.keys() == expected.keys()
    differing = [name for name in expected if not torch.equal(expected[name], got[name])]
    assert not differing, f"differ from the run without the fault: {differing}"
    history = committed_history(read_records(faulty / "samples"))
    assert sorted(history) == list(range(1, STEPS + 1))
    by_epoch: dict[int, list[int]] = {}
    for records in history.values():
        for record in records:
            by_epoch.setdefault(record["epoch"], []).extend(record["indices"])
    for epoch in (0, 1):
        assert sorted(by_epoch[epoch]) == list(range(DATASET)), f"epoch {epoch}: not exactly once"
    assert len(by_epoch[2]) == len(set(by_epoch[2])) == (STEPS - 20) * BATCH


def _heal_times(log: str) -> list[str]:
    return re.findall(r"epoch \d+ formed in ([\d.]+) s", log)


def _first_step_after(run: Path, generation: int, killed_unix: float) -> float:
    """Seconds from the kill to the first step the healed group completed (sample log clocks)."""
    gen = generations(run / "samples")[generation]
    return min(gen.done_times.values()) - killed_unix


@pytest.mark.parametrize("api", ["loop", "trainer"])
def test_fsdp_worker_sigkill_heals_in_place_and_two_neighbours_fall_back(
    etcd_server, unique_id: str, tmp_path: Path, api: str
) -> None:
    reference, faulty = tmp_path / "reference", tmp_path / "faulty"
    route = ["--api", api]
    with agents() as started:
        started.append(_start(etcd_server.endpoint, f"{unique_id}-ref", reference, 3, route))
        started.append(
            node := _start(etcd_server.endpoint, f"{unique_id}-faulty", faulty, 3, route)
        )
        _wait_between_steps(faulty, 6, 3, started)
        first = kill_rank(node, faulty / "samples", 1)
        first_unix = time.time()
        wait_for(
            lambda: len(generations(faulty / "samples")) == 2,
            timeout=60,
            what="the heal",
            describe=lambda: tails(started),
        )
        _wait_step(faulty, 13, started)
        newest = generations(faulty / "samples")[-1]
        pair = [newest.pids[1], newest.pids[2]]
        for pid in pair:
            os.kill(pid, 9)
        for agent in started:
            assert agent.wait(200) == 0, tails(started)
    log = node.output()
    print(
        f"SIGKILLed rank 1 (pid {first}), then ranks 1 and 2 (pids {pair}); epochs formed in "
        f"{_heal_times(log)} s; first step after the first fault "
        f"{_first_step_after(faulty, 1, first_unix):.2f} s after the kill"
    )

    gens = generations(faulty / "samples")
    assert len(gens) == 3, [(g.resumed_step, g.pids) for g in gens]
    assert gens[1].pids[0] == gens[0].pids[0] and gens[1].pids[2] == gens[0].pids[2], (
        "the survivors of the first fault kept their processes"
    )
    assert gens[2].pids[0] == gens[0].pids[0], "rank 0 kept its process through both faults"
    # 6: the heal went on from the step every rank held; 5: the kill cut the exchange of step 6's
    # copy (a loaded machine), and rank 1's shard came from the generation before it.
    assert gens[1].resumed_step in (5, 6), [(g.resumed_step, g.pids) for g in gens]
    cut = 6 - gens[1].resumed_step
    healed = (
        rf"shards of step {gens[1].resumed_step} restored in place "
        rf"\(rank 1's from rank 0's neighbour copy[^\n]*\): {cut} step\(s\) redone"
    )
    assert re.search(healed, log), log[-4000:]
    fallback = re.search(
        r"heal: no copy of every shard survived \(rank 2's shard and its copy on rank 1 are gone\): "
        r"every rank resumed from the newest checkpoint \(step (\d+)\): (\d+) step\(s\) redone",
        log,
    )
    assert fallback is not None, log[-4000:]
    resumed, redone = int(fallback[1]), int(fallback[2])
    assert resumed == gens[2].resumed_step and resumed % 5 == 0
    assert gens[1].last_step - resumed <= redone <= gens[1].last_step + 1 - resumed and redone > 0
    _check_exact(reference, faulty)


@pytest.mark.parametrize("api", ["loop", "trainer"])
def test_hsdp_2x2_a_lost_shard_comes_from_its_replica(
    etcd_server, unique_id: str, tmp_path: Path, api: str
) -> None:
    reference, faulty = tmp_path / "reference", tmp_path / "faulty"
    hsdp = ["--replicas", "2", "--api", api]
    with agents() as started:
        started.append(_start(etcd_server.endpoint, f"{unique_id}-ref", reference, 4, hsdp))
        started.append(node := _start(etcd_server.endpoint, f"{unique_id}-faulty", faulty, 4, hsdp))
        _wait_between_steps(faulty, 7, 4, started)
        killed = kill_rank(node, faulty / "samples", 1)
        killed_unix = time.time()
        for agent in started:
            assert agent.wait(200) == 0, tails(started)
    log = node.output()
    print(
        f"SIGKILLed rank 1 (pid {killed}); epoch formed in {_heal_times(log)} s; first step "
        f"{_first_step_after(faulty, 1, killed_unix):.2f} s after the kill"
    )
    gens = generations(faulty / "samples")
    assert len(gens) == 2
    assert all(gens[1].pids[r] == gens[0].pids[r] for r in (0, 2, 3)), (
        "the survivors kept their processes"
    )
    assert "rank 1's from rank 3's live state): 0 step(s) redone" in log, log[-4000:]
    _check_exact(reference, faulty)
