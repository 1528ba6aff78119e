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


def _diff(plain: str = "plain.py", ported: str = "elastic.py") -> str:
    done = subprocess.run(
        ["diff", "-u", "-w", "-B", "--label", plain, "--label", ported,
         str(NANOGPT / plain), str(NANOGPT / ported)],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    return done.stdout


def _added(diff: str) -> list[str]:
    return [
        line[1:]
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++") and line[1:].strip()
    ]


def test_the_page_shows_the_files_diff_and_it_adds_at_most_ten_lines() -> None:
    diff = _diff()
    shown = re.search(r"```diff\n(.*?)```", (REPO / "docs" / "own-loop.md").read_text(), re.S)
    assert shown and shown.group(1) == diff, "docs/own-loop.md shows the diff of docs/nanogpt/"
    added = _added(diff)
    imports = [line for line in added if line.startswith(("import ", "from "))]
    assert len(added) <= 10 and imports == ["from elastic_trainer import Elastic"], added


def test_the_nanogpt_shaped_port_is_shown_and_adds_at_most_ten_lines() -> None:
    """The porting guide's diff is that of docs/nanogpt/train.py and its port (issue 40 item 4);
    the port takes its counter from the step and keeps no code after ``with step:``."""
    diff = _diff("train.py", "train_elastic.py")
    page = (REPO / "docs" / "own-loop.md").read_text()
    section = page.split("## Porting a nanoGPT-shaped script", 1)[1].split("\n## ", 1)[0]
    shown = re.search(r"```diff\n(.*?)```", section, re.S)
    assert shown and shown.group(1) == diff, "the guide shows the diff of the two scripts"
    added = _added(diff)
    imports = [line for line in added if line.startswith(("import ", "from "))]
    assert len(added) <= 10 and imports == ["from elastic_trainer import Elastic"], added
    assert "    iter_num, master_process = step.number - 1, elastic.env.is_rank0" in added
    port = (NANOGPT / "train_elastic.py").read_text()
    body = port.split("for step in elastic:\n", 1)[1]
    assert all(line.startswith("        ") for line in body.splitlines()[2:] if line.strip())


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
    assert "not saved" not in done.stderr, "the state checks name nothing in the snippet"
    assert list((tmp_path / "ckpt").glob("ckpt-*200.dcp")), "a sharded checkpoint of the last step"


def _run(directory: Path, max_steps: int) -> None:
    import torch
    from torch import nn

    from elastic_trainer import Elastic

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
    elastic = Elastic(
        model,
        len(data),
        global_batch_size=4,
        max_steps=max_steps,
        checkpoint_dir=str(directory / "ckpt"),
        checkpoint_every=4,
        record_samples_dir=str(directory / "samples"),
        log_every=1000,
    )
    for step in elastic:
        with step:
            for micro in step:
                step.backward(model(data[list(micro.indices)]).square().mean() * step.weight)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def test_the_audit_script_counts_a_rolled_back_step_once(tmp_path: Path) -> None:
    import json

    _run(tmp_path, max_steps=6)
    for final in (tmp_path / "ckpt").glob("ckpt-*6*"):  # lost: the next run resumes from step 4
        final.unlink()
    # The restart is another process in a real job (its own file, named by its pid); both runs are
    # this one here.
    for path in (tmp_path / "samples").glob("*.jsonl"):
        path.rename(path.with_name("samples-rank0000-pid0.jsonl"))
    _run(tmp_path, max_steps=8)  # redoes steps 5 and 6
    done = [
        json.loads(line)["step"]
        for path in (tmp_path / "samples").glob("*.jsonl")
        for line in path.read_text().splitlines()
        if '"event":"done"' in line
    ]
    assert sorted(done) == [1, 2, 3, 4, 5, 5, 6, 6, 7, 8], "the naive count sees 5 and 6 twice"
    page = (REPO / "docs" / "own-loop.md").read_text()
    section = page.split("## Auditing exactly-once data", 1)[1]
    script = re.search(r"```python\n(.*?)```", section, re.S)
    assert script
    (tmp_path / "audit.py").write_text(script.group(1))
    done_run = subprocess.run(
        [sys.executable, "audit.py", "samples"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done_run.returncode == 0, done_run.stderr[-2000:]
    # 8 steps of 4 samples (an epoch is 5 steps of 20 samples): each sample once per epoch.
    assert done_run.stdout.strip() == "8 steps, 32 samples, 0 seen twice in an epoch"


def test_the_per_rank_snippet_runs_as_written_with_no_state_warning(tmp_path: Path) -> None:
    """The micro-batch rule's snippet (docs/own-loop.md, "Per-rank state"): it trains, updates its
    tracker once per step, and the state checks name nothing in it."""
    page = (REPO / "docs" / "own-loop.md").read_text()
    section = page.split("## Per-rank state and your own generators", 1)[1]
    script = re.search(r"```python\n(.*?)```", section, re.S)
    assert script and "tracker.update(step_loss)" in script.group(1)
    (tmp_path / "per_rank.py").write_text(script.group(1))
    done = subprocess.run(
        [sys.executable, "per_rank.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "training finished at step 50" in done.stderr, done.stderr[-2000:]
    assert "WARNING" not in done.stderr, done.stderr[-2000:]


def test_every_name_the_page_imports_from_elastic_trainer_is_exported() -> None:
    """Each ``from elastic_trainer import a, b`` the page shows (code or prose) resolves, so a name
    the page advises (such as ``exit_process``) is one a user can import."""
    import elastic_trainer

    page = (REPO / "docs" / "own-loop.md").read_text()
    names = {
        name.strip()
        for group in re.findall(r"from elastic_trainer import\s+([\w, ]+)", page)
        for name in group.split(",")
        if name.strip()
    }
    assert "exit_process" in names
    missing = sorted(name for name in names if name not in elastic_trainer.__all__)
    assert not missing, f"docs/own-loop.md imports names elastic_trainer does not export: {missing}"
    assert callable(elastic_trainer.exit_process)
