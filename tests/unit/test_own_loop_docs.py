"""docs/own-loop.md shows the real diff between docs/nanogpt/plain.py and elastic.py, and it keeps
the promise: at most 10 added lines (whitespace and blank lines ignored), one of them the import, and no deeper
nesting of the step body. Its FSDP2 script runs as written (one process; its heal under
``elastic-trainer run`` is the Trainer's path, tests/chaos/test_sharded_heal.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NANOGPT = REPO / "docs" / "nanogpt"


def _diff() -> str:
    done = subprocess.run(
        [
            "diff",
            "-u",
            "-w",
            "-B",
            "--label",
            "plain.py",
            "--label",
            "elastic.py",
            str(NANOGPT / "plain.py"),
            str(NANOGPT / "elastic.py"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1, done.stderr
    return done.stdout


def test_the_page_shows_the_files_diff_and_it_adds_at_most_ten_lines() -> None:
    diff = _diff()
    shown = re.search(r"```diff\n(.*?)```", (REPO / "docs" / "own-loop.md").read_text(), re.S)
    assert shown and shown.group(1) == diff, "docs/own-loop.md shows the diff of docs/nanogpt/"
    added = [
        line[1:]
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++") and line[1:].strip()
    ]
    imports = [line for line in added if line.startswith(("import ", "from "))]
    assert len(added) <= 10 and imports == ["from elastic_trainer import Elastic"], added


def test_the_step_body_is_not_nested_deeper() -> None:
    def depth(path: Path, marker: str) -> int:
        line = next(line for line in path.read_text().splitlines() if marker in line)
        return (len(line) - len(line.lstrip())) // 4

    assert (
        depth(NANOGPT / "elastic.py", "F.cross_entropy")
        <= depth(NANOGPT / "plain.py", "F.cross_entropy") + 1
    )


def test_the_fsdp_script_runs_as_written(tmp_path: Path) -> None:
    page = (REPO / "docs" / "own-loop.md").read_text()
    section = page.split("## A model you shard yourself (FSDP2)", 1)[1]
    script = re.search(r"```python\n(.*?)```", section, re.S)
    assert script and "with ElasticGroup() as group:" in script.group(1)
    assert "group=group, rebuild=build" in script.group(1)
    (tmp_path / "fsdp_own.py").write_text(script.group(1))
    done = subprocess.run(
        [sys.executable, "fsdp_own.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "training finished at step 200" in done.stderr, done.stderr[-2000:]
    assert list((tmp_path / "ckpt").glob("ckpt-*200.dcp")), "a sharded checkpoint of the last step"
