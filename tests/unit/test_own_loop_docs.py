"""docs/own-loop.md shows the real diff between docs/nanogpt/plain.py and elastic.py, and it keeps
the promise: at most 10 added lines (whitespace and blank lines ignored), one of them the import, and no deeper
nesting of the step body."""

from __future__ import annotations

import re
import subprocess
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
