"""Checkpoint faults on a two-node job: the disk fills up during a checkpoint, and the newest
checkpoint is corrupted before a restart.

The world size never changes, so after each the final weights must be bitwise the no-fault
run's, with every sample consumed exactly once per epoch and no good checkpoint lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.faults import (
    FaultInjector,
    JobSpec,
    RunDirs,
    corrupt_newest_checkpoint,
    freeze_workers,
    kill,
    small_disk,
    start_node,
    tails,
    unique_run_id,
    wait_all,
)
from tests.chaos.invariants import check_run, describe
from tests.runtime_helpers import agents

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

JOB = JobSpec()
CHECKPOINT_BYTES = 90_000  # one checkpoint of the chaos job: .pt 81 kB, manifest 1.5 kB


def test_disk_full_during_a_checkpoint(etcd_server, no_fault, tmp_path: Path) -> None:
    """The checkpoint disk (a small tmpfs) fills up just before a checkpoint: the write fails
    with a clear error on every rank, the previous checkpoint is untouched, the group restarts
    from it; once an operator frees the disk the job completes."""
    with small_disk(tmp_path / "disk", 64 * CHECKPOINT_BYTES) as disk, agents() as nodes:
        run = RunDirs.under(tmp_path / "run", checkpoints=disk.mountpoint / "ckpt")
        run_id = unique_run_id("disk-full")
        for name in ("a", "b"):
            nodes.append(start_node(name=name, run=run, job=JOB, endpoint=etcd_server.endpoint, run_id=run_id,
                                    nnodes="2"))
        node_a = nodes[0]

        def disk_full_reported(step: int) -> bool:
            return any("the disk is full" in node.output() for node in nodes)

        faults = (FaultInjector(run)
                  .at_step(12, "disk filled to less than a checkpoint", lambda: disk.fill(CHECKPOINT_BYTES // 3))
                  .when(disk_full_reported, "operator frees the disk", disk.free))
        faults.run_until(lambda: node_a.proc.poll() is not None, timeout=150, agents=nodes)
        codes = wait_all(nodes, timeout=30)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(nodes)}"
        logs = "\n".join(node.output() for node in nodes)
        summary = check_run(run, JOB, no_fault, reference_world=2)
    print(describe(summary))
    failed = [line for line in logs.splitlines() if "could not write the checkpoint" in line]
    assert failed and "is untouched" in failed[0], f"no clear error for the full disk: {failed[:1]}"
    print(failed[0])
    assert len(summary.generations) >= 2, "the failed write restarted the group"


def test_newest_checkpoint_corrupted(etcd_server, no_fault, run_dirs: RunDirs) -> None:
    """The newest checkpoint is damaged while the job stands still, then every worker dies at once
    (no survivor to save the last step just in time): the restart skips the damaged file (naming
    it), sets it aside, and resumes from the one before."""
    run_id = unique_run_id("corrupt")
    damaged: set[int] = set()
    with agents() as nodes:
        for name in ("a", "b"):
            nodes.append(start_node(name=name, run=run_dirs, job=JOB, endpoint=etcd_server.endpoint, run_id=run_id,
                                    nnodes="2"))
        node_a, node_b = nodes

        def corrupt_then_kill_all() -> None:
            frozen = freeze_workers(nodes)
            try:
                damaged.add(corrupt_newest_checkpoint(run_dirs.checkpoints))
            finally:
                kill(frozen)

        faults = FaultInjector(run_dirs).at_step(22, "newest checkpoint corrupted, then every worker SIGKILLed",
                                                 corrupt_then_kill_all)
        faults.run_until(lambda: node_a.proc.poll() is not None, timeout=150, agents=nodes)
        codes = wait_all(nodes, timeout=30)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(nodes)}"
        logs = "\n".join(node.output() for node in nodes)

    summary = check_run(run_dirs, JOB, no_fault, reference_world=2, damaged=damaged)
    print(describe(summary), "damaged", damaged)
    (step,) = damaged
    assert summary.generations[1].resumed_step == step - JOB.checkpoint_every
    assert (run_dirs.checkpoints / f"ckpt-{step:012d}.pt.corrupt").exists(), "the damaged file was set aside"
    assert f"ckpt-{step:012d}.pt is corrupt" in logs, "the skipped checkpoint is named in the log"
