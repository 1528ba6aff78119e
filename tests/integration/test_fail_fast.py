"""Failures that a restart cannot heal stop the job at once, with the root cause as one line;
an error in the user's code gets one restart and stops when it comes back at the same step.

Real `elastic-trainer run` (embedded etcd, torchrun's agent, two gloo workers), cold and warm
worker starts. A worker SIGKILL still heals (tests/integration/test_warm_start.py and the chaos
suite): only the failures below stop the job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.ci import IN_CI

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [
    sys.executable,
    "-m",
    "elastic_trainer.cli",
    "run",
    "--nproc-per-node",
    "2",
    "--nnodes",
    "1",
    "--max-restarts",
    "3",
    "--metrics-port",
    "0",
    "--device",
    "cpu",
]
EXAMPLE = [
    "-m",
    "elastic_trainer.examples.synthetic_cnn",
    "--max-steps",
    "6",
    "--dataset-size",
    "96",
    "--global-batch-size",
    "8",
]

POISONED_SAMPLE_IN_STEP_3 = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from elastic_trainer.runtime import failures
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.train.config import TrainerConfig
from elastic_trainer.runtime.process_exit import exit_process
from elastic_trainer.train.trainer import Trainer, TrainingJob

def data():
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 2, (64,), generator=g)
    targets[17] = 7  # a bad label: samples 16..23 make step 3 (no shuffling, 8 per step)
    return TensorDataset(torch.randn(64, 4, generator=g), targets)

job = TrainingJob(model=lambda: nn.Linear(4, 2), dataset=data, loss=nn.functional.cross_entropy,
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
config = TrainerConfig(global_batch_size=8, max_steps=10, shuffle=False, checkpoint=CheckpointConfig(directory=CKPT),
                       log_every=1000)
try:
    Trainer(config, job).fit()
except Exception as exc:
    exit_process(failures.exit_after(exc, prog="user_job"))
"""


def _run(*target: str, warm: str = "off", timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ELASTIC_TRAINER_METRICS", None)
    try:
        return subprocess.run(
            [*LAUNCH, "--warm-start", warm, *target],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        stderr = (
            exc.stderr.decode(errors="replace")
            if isinstance(exc.stderr, bytes)
            else (exc.stderr or "")
        )
        pytest.fail(f"the job did not end within {timeout} s; its stderr ends:\n{stderr[-6000:]}")


def _restarts(done: subprocess.CompletedProcess[str]) -> int:
    return done.stderr.count("restarting the worker group")


def _job_failed_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if "job failed:" in line]
    assert len(lines) == 1, done.stderr[-4000:]
    return lines[0]


def _script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("warm", ["off", "on"])
def test_syntax_error_stops_at_once_with_one_line(tmp_path: Path, warm: str) -> None:
    script = _script(tmp_path, "broken.py", "import os\nx = (1,\nprint(x)\n")
    done = _run(script, warm=warm)
    assert done.returncode == 2, done.stderr[-3000:]
    line = _job_failed_line(done)
    assert (
        "SyntaxError" in line
        and "broken.py, line 2" in line
        and "a restart cannot fix this" in line
    )
    assert _restarts(done) == 0, "no restart spent"
    assert "Traceback" not in done.stderr, "no tracebacks from the ranks"


def test_import_error_and_exit_2_stop_at_once(tmp_path: Path) -> None:
    missing = _run(_script(tmp_path, "imports.py", "import no_such_module_anywhere\n"))
    assert missing.returncode == 2 and _restarts(missing) == 0, missing.stderr[-3000:]
    assert "No module named 'no_such_module_anywhere'" in _job_failed_line(missing)
    assert "Traceback" not in missing.stderr
    usage = _run(_script(tmp_path, "usage.py", "import sys\nsys.exit(2)\n"))
    assert usage.returncode == 2 and _restarts(usage) == 0, usage.stderr[-3000:]
    assert "exited with status 2 (a usage error)" in _job_failed_line(usage)


def test_user_exception_repeating_at_the_same_step_gets_one_restart_and_one_traceback(
    tmp_path: Path,
) -> None:
    script = _script(
        tmp_path, "poisoned.py", f"CKPT = {str(tmp_path / 'ckpt')!r}\n" + POISONED_SAMPLE_IN_STEP_3
    )
    done = _run(script)
    assert done.returncode == 1, done.stderr[-4000:]
    assert _restarts(done) == 1, done.stderr[-4000:]
    line = _job_failed_line(done)
    assert "IndexError: Target 7 is out of bounds. (in step 3)" in line, line
    assert "again after a restart" in line
    assert done.stderr.count("Traceback (most recent call last)") == 1, "the traceback, once"
    assert done.stderr.rstrip().splitlines()[-1] == line, "the root cause is the last line"


def test_checkpoint_directory_problems_stop_at_once(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    done = _run(*EXAMPLE, "--checkpoint-dir", str(a_file))
    assert done.returncode == 2 and _restarts(done) == 0, done.stderr[-3000:]
    assert f"checkpoint_dir {a_file} exists and is not a directory" in _job_failed_line(done)

    owner = tmp_path / "owner"
    assert _run(*EXAMPLE, "--checkpoint-dir", str(owner), "--width", "8").returncode == 0
    foreign = _run(*EXAMPLE, "--checkpoint-dir", str(owner), "--width", "16")
    assert foreign.returncode == 2 and _restarts(foreign) == 0, foreign.stderr[-3000:]
    assert "belongs to a different job" in _job_failed_line(foreign)
    assert "Traceback" not in foreign.stderr


def test_read_only_checkpoint_directory_stops_at_once(tmp_path: Path) -> None:
    """A read-only file system (root ignores directory permissions, so a real read-only mount)."""
    mountpoint = tmp_path / "ro"
    mountpoint.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mountpoint)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        if IN_CI:
            pytest.fail(f"CI must be able to mount a read-only tmpfs: {mounted.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        done = _run(*EXAMPLE, "--checkpoint-dir", str(mountpoint / "ckpt"))
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
    assert done.returncode == 2 and _restarts(done) == 0, done.stderr[-3000:]
    assert "cannot be used: Read-only file system" in _job_failed_line(done)
