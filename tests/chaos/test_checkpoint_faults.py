"""Checkpoint faults on a two-node job: the disk fills up during a checkpoint (the job stops; the
operator frees the disk and starts it again), and the newest checkpoint is corrupted before a
restart.

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
    start_nodes,
    unique_run_id,
    wait_all,
)
from tests.chaos.invariants import check_run, describe
from tests.support.agents import agents, tails

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

JOB = JobSpec()
CHECKPOINT_BYTES = 90_000  # one checkpoint of the chaos job: .pt 81 kB, manifest 1.5 kB


def test_disk_full_during_a_checkpoint(etcd_server, no_fault, tmp_path: Path) -> None:
    """The checkpoint disk (a small tmpfs) fills up just before a checkpoint: no restart can fix
    that, so the job stops at once (no restart spent) with the cause as one line on both nodes, and
    the previous checkpoint is untouched. The operator frees the disk and starts the job again: it
    resumes from that checkpoint and completes, exactly once and bitwise."""
    with small_disk(tmp_path / "disk", 64 * CHECKPOINT_BYTES) as disk, agents() as nodes:
        run = RunDirs.under(tmp_path / "run", checkpoints=disk.mountpoint / "ckpt")
        first_id = unique_run_id("disk-full")
        start_nodes(
            nodes,
            ("a", "b"),
            run=run,
            job=JOB,
            endpoint=etcd_server.endpoint,
            run_id=first_id,
            nnodes="2",
        )
        faults = FaultInjector(run).at_step(
            12, "disk filled to less than a checkpoint", lambda: disk.fill(CHECKPOINT_BYTES // 3)
        )
        faults.run_until(
            lambda: all(node.proc.poll() is not None for node in nodes), timeout=150, agents=nodes
        )
        codes = wait_all(nodes, timeout=30)
        logs = "\n".join(node.output() for node in nodes)
        assert codes[nodes[0].log_path.name] == 2, f"exit codes {codes}\n{tails(nodes)}"
        assert "restarting the worker group" not in logs, "no restart spent on a full disk"
        # Each node says why it failed; the node of the rank that wrote names the cause.
        failed = [line for line in logs.splitlines() if "job failed:" in line]
        cause = [line for line in failed if "the disk is full" in line and "is untouched" in line]
        assert failed and cause, tails(nodes)
        print(cause[0])

        disk.free()  # the operator's part, then the same job again
        second_id = unique_run_id("disk-freed")
        restarted = [
            start_node(
                name=f"{name}2",
                run=run,
                job=JOB,
                endpoint=etcd_server.endpoint,
                run_id=second_id,
                nnodes="2",
            )
            for name in ("a", "b")
        ]
        nodes.extend(restarted)
        codes = wait_all(restarted, timeout=150)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(restarted)}"
        summary = check_run(run, JOB, no_fault, reference_world=2)
    print(describe(summary))
    assert len(summary.generations) == 2, (
        "one generation before the full disk, one after the operator's restart"
    )


def test_newest_checkpoint_corrupted(etcd_server, no_fault, run_dirs: RunDirs) -> None:
    """The newest checkpoint is damaged while the job stands still, then every worker dies at once
    (no survivor to save the last step just in time): the restart skips the damaged file (naming
    it), sets it aside, and resumes from the one before."""
    run_id = unique_run_id("corrupt")
    damaged: set[int] = set()
    with agents() as nodes:
        start_nodes(
            nodes,
            ("a", "b"),
            run=run_dirs,
            job=JOB,
            endpoint=etcd_server.endpoint,
            run_id=run_id,
            nnodes="2",
        )
        node_a, node_b = nodes

        def corrupt_then_kill_all() -> None:
            frozen = freeze_workers(nodes)
            try:
                damaged.add(corrupt_newest_checkpoint(run_dirs.checkpoints))
            finally:
                kill(frozen)

        faults = FaultInjector(run_dirs).at_step(
            22, "newest checkpoint corrupted, then every worker SIGKILLed", corrupt_then_kill_all
        )
        faults.run_until(lambda: node_a.proc.poll() is not None, timeout=150, agents=nodes)
        codes = wait_all(nodes, timeout=30)
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{tails(nodes)}"
        logs = "\n".join(node.output() for node in nodes)

    summary = check_run(run_dirs, JOB, no_fault, reference_world=2, damaged=damaged)
    print(describe(summary), "damaged", damaged)
    (step,) = damaged
    assert summary.generations[1].resumed_step == step - JOB.checkpoint_every
    assert (run_dirs.checkpoints / f"ckpt-{step:012d}.pt.corrupt").exists(), (
        "the damaged file was set aside"
    )
    assert f"ckpt-{step:012d}.pt is corrupt" in logs, "the skipped checkpoint is named in the log"
