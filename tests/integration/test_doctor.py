"""``python -m elastic_trainer.doctor`` for real: torchrun (standalone), two gloo workers.

The healthy run must pass every check and print the bandwidth table; each self-test fault
(``ELASTIC_TRAINER_DOCTOR_FAULT``) must turn exactly its check to FAIL with a non-zero exit,
and a peer that never joins must be reported after ``--timeout``, not waited for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from elastic_trainer.doctor.checks import usable_cpus
from elastic_trainer.doctor.report import CHECKS

pytestmark = pytest.mark.integration

FAST = ["--sizes", "1K,64K", "--iters", "3", "--warmup", "1", "--deadline", "90"]
TIMING_CHECKS = {"compute_comm"}
"""Checks whose status depends on measured times (WARN on a loaded machine is legitimate)."""


def doctor(
    *args: str, env: dict[str, str] | None = None, torchrun: bool = True, timeout: float = 150
) -> tuple[subprocess.CompletedProcess[str], float]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCH_NCCL_", "NCCL_", "ELASTIC_TRAINER_", "TORCHELASTIC_"))
        and k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    }
    clean["OMP_NUM_THREADS"] = "1"
    clean.update(env or {})
    launcher = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            "--monitor-interval=0.2",
        ]
        if torchrun
        else [sys.executable]
    )
    began = time.monotonic()
    done = subprocess.run(
        [*launcher, "-m", "elastic_trainer.doctor", *args],
        capture_output=True,
        text=True,
        env=clean,
        timeout=timeout,
    )
    return done, time.monotonic() - began


def may_warn_here() -> set[str]:
    """Checks that may legitimately WARN on this machine: timings, and two ranks on fewer than
    two usable cores (oversubscription)."""
    return TIMING_CHECKS | ({"devices"} if usable_cpus() < 2 else set())


def explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr (end)\n{done.stderr[-8000:]}"


def status_lines(stdout: str) -> dict[str, str]:
    """``{check: status}`` from the text report's check lines."""
    found = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("PASS", "WARN", "FAIL", "SKIP") and parts[1] in CHECKS:
            found[parts[1]] = parts[0]
    return found


@pytest.mark.timeout(180)
def test_healthy_two_rank_run_passes_every_check() -> None:
    done, _ = doctor(*FAST)
    assert done.returncode == 0, explain(done)
    statuses = status_lines(done.stdout)
    assert set(statuses) == set(CHECKS)
    may_warn = may_warn_here()
    for name, status in statuses.items():
        allowed = {"PASS", "WARN"} if name in may_warn else {"PASS"}
        assert status in allowed, f"{name}: {status}\n{done.stdout}"
    assert "elastic-trainer doctor: 2 rank(s) on 1 node(s), backend gloo" in done.stdout
    assert done.stdout.count("elastic-trainer doctor:") == 1  # one report, from rank 0
    header = next(line for line in done.stdout.splitlines() if "busbw(GB/s)" in line)
    assert header.split() == ["size", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)"]
    rows = [
        line.split()
        for line in done.stdout.splitlines()
        if line.strip().startswith(("1 KiB", "64 KiB"))
    ]
    assert [row[:3] for row in rows] == [["1", "KiB", "256"], ["64", "KiB", "16384"]]
    assert done.stdout.rstrip().splitlines()[-1].startswith("RESULT: ")


@pytest.mark.timeout(180)
def test_json_report_is_complete_and_parseable() -> None:
    done, _ = doctor("--json", *FAST)
    assert done.returncode == 0, explain(done)
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["ranks"] == 2 and report["backend"] == "gloo"
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == list(CHECKS)
    assert checks["allreduce"]["data"] == {
        "expected": 1,
        "int64": 1,
        "float32_min": 1.0,
        "float32_max": 1.0,
    }
    assert checks["grad_sync"]["data"]["params_spread"] == 0.0
    assert (
        checks["grad_sync"]["data"]["local_grads_spread"] > 0
    )  # the ranks' inputs really differed
    rows = checks["bandwidth"]["data"]["rows"]
    assert [r["size_bytes"] for r in rows] == [1024, 65536]
    for row in rows:  # two ranks: busbw = algbw * 2(n-1)/n = algbw
        assert row["time_us"] > 0 and row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])
        assert row["algbw_gbps"] == pytest.approx(row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9)
    ratio = checks["compute_comm"]["data"]
    assert ratio["ratio"] == pytest.approx(ratio["compute_ms"] / ratio["comm_ms"])
    assert "doctor's CNN" in ratio["model"]


@pytest.mark.timeout(180)
def test_allreduce_fault_fails_the_allreduce_check_on_every_rank() -> None:
    done, _ = doctor(*FAST, env={"ELASTIC_TRAINER_DOCTOR_FAULT": "allreduce"})
    assert done.returncode != 0
    statuses = status_lines(done.stdout)
    assert statuses["allreduce"] == "FAIL", done.stdout
    assert {s for n, s in statuses.items() if n not in {"allreduce", *may_warn_here()}} == {"PASS"}
    line = next(line for line in done.stdout.splitlines() if line.startswith("FAIL  allreduce"))
    assert (
        "ranks 0,1: sum of ranks is 2 (int64) and 2 (float32), expected n(n-1)/2 = 1 for n=2"
        in line
    )
    assert "SELF-TEST" in done.stdout


@pytest.mark.timeout(180)
def test_grad_sync_and_placement_faults_fail_their_checks() -> None:
    done, _ = doctor(*FAST, env={"ELASTIC_TRAINER_DOCTOR_FAULT": "grad_sync,placement"})
    assert done.returncode != 0
    statuses = status_lines(done.stdout)
    assert statuses["grad_sync"] == "FAIL" and statuses["placement"] == "FAIL", done.stdout
    assert statuses["allreduce"] == "PASS"
    lines = done.stdout.splitlines()
    assert any(
        line.startswith("FAIL  placement") and "rank 1: expected cpu: batch on meta" in line
        for line in lines
    )
    assert any(
        line.startswith("FAIL  grad_sync") and "gradients differ between ranks" in line
        for line in lines
    )


@pytest.mark.timeout(120)
def test_a_peer_that_never_joins_is_reported_after_the_timeout_not_waited_for() -> None:
    done, elapsed = doctor(
        "--sizes",
        "1K",
        "--iters",
        "2",
        "--timeout",
        "3",
        "--deadline",
        "40",
        env={"ELASTIC_TRAINER_DOCTOR_FAULT": "hang"},
    )
    assert done.returncode != 0
    assert elapsed < 40, f"took {elapsed:.0f} s"
    lines = done.stdout.splitlines()
    assert any(
        line.startswith("FAIL  allreduce") and "Timed out" in line and "--timeout=3s" in line
        for line in lines
    ), explain(done)
    statuses = status_lines(done.stdout)
    assert statuses["grad_sync"] == statuses["bandwidth"] == "SKIP"  # not run into the broken group
    assert "PARTIAL REPORT" in done.stdout


@pytest.mark.timeout(180)
def test_inconsistent_timeouts_warn_without_failing() -> None:
    done, _ = doctor(*FAST, env={"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60", "NCCL_TIMEOUT": "1800"})
    assert done.returncode == 0, explain(done)
    line = next(line for line in done.stdout.splitlines() if line.split()[1:2] == ["timeouts"])
    assert line.startswith("WARN") and "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=60 is below" in line
    assert "NCCL_TIMEOUT is read by neither" in line


@pytest.mark.timeout(60)
def test_inconsistent_environment_by_hand_fails_the_env_check_quickly() -> None:
    done, elapsed = doctor(*FAST, torchrun=False, env={"RANK": "5", "WORLD_SIZE": "2"})
    assert done.returncode == 1
    assert elapsed < 40
    line = next(line for line in done.stdout.splitlines() if line.startswith("FAIL  env"))
    assert "RANK=5 is not in 0..WORLD_SIZE-1 (WORLD_SIZE=2)" in line
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(60)
def test_bad_flag_under_torchrun_is_one_line_from_rank_0() -> None:
    done, _ = doctor("--sizes", "3", "--deadline", "30")
    assert done.returncode != 0
    errors = [
        line
        for line in done.stderr.splitlines()
        if line.startswith("elastic-trainer doctor: error:")
    ]
    assert errors == [
        "elastic-trainer doctor: error: argument --sizes: size 3 B: must be a positive multiple "
        "of 4 bytes (float32)"
    ]
    assert done.stdout == ""


@pytest.mark.timeout(60)
def test_the_deadline_ends_a_rank_stuck_for_good_with_a_report() -> None:
    """One process, hung on purpose inside a check: the watchdog prints what it has and exits."""
    done, elapsed = doctor(
        "--sizes",
        "1K",
        "--iters",
        "2",
        "--timeout",
        "1",
        "--deadline",
        "4",
        torchrun=False,
        env={"ELASTIC_TRAINER_DOCTOR_FAULT": "hang"},
    )
    assert done.returncode == 1
    assert elapsed < 30
    lines = done.stdout.splitlines()
    assert any(
        line.startswith("FAIL  allreduce") and "did not finish within --deadline=4s" in line
        for line in lines
    ), explain(done)
    assert "PARTIAL REPORT: stopped after --deadline=4s in the allreduce check" in done.stdout
    assert "deadline of 4 s exceeded in the allreduce check" in done.stderr
