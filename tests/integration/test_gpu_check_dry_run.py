"""``bash scripts/gpu-check.sh --dry-run OUT`` on this CPU machine: every step of the GPU check
runs (the real benchmarks and the gpu-marked tests, tiny sizes), within its limit, and the table
has every row, so that the script cannot rot between the rare GPU runs. One run serves every
assertion (about 50 s on 2 quiet cores, 45 s of CPU).

    pytest tests/integration/test_gpu_check_dry_run.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu_check.plan import PLAN
from benchmarks.gpu_check.runner import GRACE_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(PLAN.dry_budget_s + 120)]

REPO = Path(__file__).resolve().parents[2]


def test_the_dry_run_runs_every_step_within_its_limit_and_prints_every_row(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check"
    started = time.monotonic()
    done = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=PLAN.dry_budget_s + 60, env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert elapsed < PLAN.dry_budget_s + 30, elapsed

    results = json.loads((out / "results.json").read_text())
    assert results["dry_run"] is True
    assert list(results["steps"]) == [s.name for s in PLAN.steps]
    for step in PLAN.steps:
        result = results["steps"][step.name]
        assert result["status"] == "ok", result
        assert result["duration_s"] <= min(step.dry_limit_s, result["limit_s"]) + 2 * GRACE_S, (
            result
        )
        assert result["figures"], result
        assert (out / f"{step.name}.log").stat().st_size > 0

    table = (out / "table.md").read_text()
    assert table in done.stdout  # printed as written
    lines = [
        line
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| claim |")
    ]
    assert len(lines) == len(PLAN.claims)
    for claim, line in zip(PLAN.claims, lines, strict=True):
        assert line.startswith(f"| {claim.claim} |"), line
        verdict = line.rsplit("|", 2)[1].strip()
        # Every measured row has a figure and a verdict; tiny CPU figures may miss GPU targets.
        assert verdict in (("pass", "fail") if claim.step else ("not built yet",)), line
    # The GPU tests ran under pytest and all skipped here: no CUDA (the dry run hides any GPU).
    gpu_tests = [r for r in results["rows"] if "tests/gpu/" in r["claim"]]
    assert len(gpu_tests) == 2 and all("0 passed, 0 failed" in r["gpu"] for r in gpu_tests), (
        gpu_tests
    )
