"""No library code draws from Python's global ``random`` generator.

A worker restores that generator bit for bit after a fault; one draw from a background thread
(an etcd retry, a lease backoff) would shift the training job's sequence. Only
``elastic_trainer/runtime/rng.py`` may touch it, to capture and restore it.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

from rendezvous import jitter

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {ROOT / "elastic_trainer" / "runtime" / "rng.py"}


def _global_random_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "random":
            found.append(f"{path.name}:{node.lineno} from random import ...")
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "random"
            and node.attr != "Random"
        ):
            found.append(f"{path.name}:{node.lineno} random.{node.attr}")
    return found


def test_library_modules_do_not_draw_from_the_global_generator() -> None:
    modules = [p for pkg in ("rendezvous", "elastic_trainer") for p in (ROOT / pkg).rglob("*.py")]
    assert len(modules) > 50
    offenders = [hit for p in modules if p not in ALLOWED for hit in _global_random_calls(p)]
    assert offenders == []


def test_the_scan_finds_a_global_draw(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import random\nfrom random import shuffle\nx = random.uniform(0, 1)\ny = random.Random()\n"
    )
    assert _global_random_calls(sample) == [
        "sample.py:2 from random import ...",
        "sample.py:3 random.uniform",
    ]


def test_jitter_draws_from_its_own_generator() -> None:
    before = random.getstate()
    draws = [jitter.uniform(0.5, 1.5) for _ in range(100)]
    waits = [jitter.wait_jitter(0, 0.1)(None) for _ in range(100)]  # type: ignore[arg-type]
    assert random.getstate() == before
    assert all(0.5 <= d <= 1.5 for d in draws) and len(set(draws)) > 90
    assert all(0 <= w <= 0.1 for w in waits)
