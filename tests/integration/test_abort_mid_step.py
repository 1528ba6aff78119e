"""Aborting a gloo group mid-step ends the step at once, every time (two real processes, DDP of
the example CNN, 25 aborts each, with the opt-in hooks that track every bucket's wait: the
metrics' timing hook given the worker's comms, and the plain tracked hook).

Without the tracked waits of ``runtime/abortable.py`` one of these aborts in a few dozen left a
rank in DDP's ``finalize_backward`` until gloo's own timeout: a bucket's send still queued when
its connection was cut is never told (the chaos suite's "survivor that never answers the round")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.scripts import abort_mid_step_worker

SCRIPT = Path(abort_mid_step_worker.__file__)
ITERATIONS = 25

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("hook", ["timed", "plain"])
def test_every_abort_ends_the_step_at_once(hook: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"out{rank}.json" for rank in range(2)]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    files = [
        log.open("w") for log in logs
    ]  # not pipes: a stack dump must never block on a full pipe
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                str(rank),
                str(tmp_path / "store"),
                str(ITERATIONS),
                hook,
                str(outs[rank]),
            ],
            env=env,
            stdout=files[rank],
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    deadline = time.monotonic() + 240
    try:
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        stuck = [rank for rank, proc in enumerate(procs) if proc.poll() is None]
        for rank in stuck:
            procs[rank].send_signal(signal.SIGUSR1)  # every thread's stack into its output
        time.sleep(1.0 if stuck else 0.0)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
    for proc, file in zip(procs, files, strict=True):
        proc.wait()
        file.close()
    outputs = [log.read_text() for log in logs]
    assert not stuck, "\n".join(
        f"rank {rank} still running after 240 s:\n{outputs[rank][-6000:]}" for rank in stuck
    ) + (
        "".join(
            f"\nrank {rank} exited {proc.returncode}:\n{outputs[rank][-3000:]}"
            for rank, proc in enumerate(procs)
            if rank not in stuck
        )
    )
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, (
            f"rank {rank} exited {proc.returncode}:\n{outputs[rank][-3000:]}"
        )
    for out in outs:
        ended = json.loads(out.read_text())["ended_after_s"]
        assert len(ended) == ITERATIONS
        assert max(ended) < abort_mid_step_worker.BOUND_S, (
            f"an abort left a step blocked: {sorted(ended)[-3:]}"
        )
