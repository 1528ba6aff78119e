"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and fail when a worker
module imports launcher code (checked on a copy of the tree with one forbidden import added)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
]


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(LINT, cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def test_the_contracts_hold() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout and done.stdout.count("KEPT") >= 5, done.stdout


def test_a_worker_module_importing_the_launcher_breaks_them(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("elastic_trainer", "rendezvous", "benchmarks", "tests"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    sampler = tree / "elastic_trainer" / "runtime" / "sampler.py"
    sampler.write_text(
        sampler.read_text() + "\nfrom elastic_trainer.launch import launcher  # noqa: E402,F401\n"
    )
    done = _lint(tree)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "elastic_trainer.runtime.sampler -> elastic_trainer.launch.launcher" in done.stdout
