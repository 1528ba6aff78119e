"""HealableGroup on real gloo processes: a collective blocked on a frozen peer fails as soon as
the group is aborted (gloo's own abort() leaves it blocked), and the survivors form a new group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "heal_group_worker.py"

pytestmark = pytest.mark.timeout(180)


def test_abort_unblocks_a_collective_waiting_on_a_frozen_peer(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                str(rank),
                str(tmp_path / "store"),
                str(tmp_path / f"out{rank}.json"),
            ],
            env=env,
        )
        for rank in range(3)
    ]
    try:
        for proc in procs[:2]:
            assert proc.wait(timeout=150) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
    for rank in range(2):
        result = json.loads((tmp_path / f"out{rank}.json").read_text())
        # The survivors were blocked on the frozen rank 2 until the abort, 1 s in; without it
        # they would have waited out the 600 s collective timeout (the test's own limit is 180 s).
        assert result["blocked_for"] is not None and result["blocked_for"] < 60
        assert result["sum"] == 3.0  # ranks 0 and 1 reduced together in the new group
