"""The launcher's exit deadline: a process that hangs after its workers ended is ended anyway."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from elastic_trainer.launch.exit_deadline import ExitDeadline

HANGS_AFTER_ARMING = """
import threading
from elastic_trainer.launch.exit_deadline import ExitDeadline
ExitDeadline(0.3).arm(7)
threading.Event().wait()  # a clean-up that never returns
"""


def test_an_armed_deadline_ends_a_hung_process_with_its_code_and_stacks() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HANGS_AFTER_ARMING], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 7, done.stderr
    assert "still running 0 s after its workers ended; exiting now with status 7" in done.stderr
    assert "Thread 0x" in done.stderr or "Current thread" in done.stderr, done.stderr  # the stacks
    assert time.monotonic() - started < 30


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bound_s"):
        ExitDeadline(0)
