"""`elastic-trainer run --dry-run` and a user's mistakes are answered without importing torch.

Importing torch takes seconds on a cold start; a typo answered in a fraction of a second is what
a user sees, and the deploy tests run the real CLI many times. Each case runs in a fresh
interpreter (this test process has torch imported already) and reports whether torch was loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import contextlib, io, json, sys
from elastic_trainer.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(), "torch": "torch" in sys.modules,
                  "grpc": "grpc" in sys.modules}))
"""


def run_cli(*args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_TRAINER_")},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_dry_run_imports_neither_torch_nor_grpc(script: str) -> None:
    result = run_cli(
        "run",
        "--dry-run",
        "--nproc-per-node",
        "2",
        "--rdzv-endpoint",
        "etcd-0:2379,etcd-1:2379",
        "--run-id",
        "job-1",
        "--rdzv-conf",
        "read_timeout=5",
        "--metrics-port",
        "9400",
        script,
    )
    assert result["code"] == 0, result["err"]
    assert "--rdzv-backend=etcd-v3" in str(result["out"]) and "--nproc-per-node=2" in str(
        result["out"]
    )
    assert result["torch"] is False and result["grpc"] is False


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rdzv-conf", "read_timout=5"], "unknown key 'read_timout'"),
        (["--rdzv-endpoint", "etcd:notaport", "--run-id", "j"], "port 'notaport'"),
        (["--rdzv-endpoint", "127.0.0.1:2379"], "--run-id is required"),
        (["--device", "cuda"], "--device cuda: no CUDA device is visible"),
    ],
)
def test_a_mistake_is_answered_without_torch(script: str, args: list[str], message: str) -> None:
    if "--device" in args:
        from elastic_trainer.launch.plan import visible_cuda_devices

        if visible_cuda_devices():
            pytest.skip("a CUDA device is visible here")
    result = run_cli("run", *args, script)
    assert result["code"] == 2 and message in str(result["err"]), result
    assert result["torch"] is False
