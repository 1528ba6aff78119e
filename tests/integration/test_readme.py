"""The README's first command, exactly as written, on this checkout."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from rendezvous.etcd_server import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert block, "README.md must open with a bash block of two commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_two_commands() -> None:
    commands = readme_commands()
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci  # CI runs the README's test command


def test_first_command_shows_faults_healing_with_metrics(tmp_path: Path) -> None:
    """The demo, shortened: a node joins, a worker is SIGKILLed, a node leaves; the summary gives
    each recovery time (real, measured) and zero steps lost, and the node served metrics meanwhile."""
    port = free_port()
    env = {
        **os.environ,
        "METRICS_PORT": str(port),
        "DEMO_DIR": str(tmp_path / "demo"),
        "MAX_STEPS": "300",
    }
    scraped: list[str] = []

    def scrape() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not scraped:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/metrics", timeout=2
                ) as response:
                    text = response.read().decode()
                if "elastic_trainer_samples_total" in text:
                    scraped.append(text)
            except OSError:
                pass
            time.sleep(0.5)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    done = subprocess.run(
        readme_commands()[0].split(), cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    scraper.join(5)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout.split("elastic-trainer demo: summary", 1)[1].splitlines()
    rows = {
        name: re.search(r"(\d+\.\d) s\s+(\d+)$", line)
        for line in summary
        for name in ("node b joins", "worker SIGKILL", "node b leaves")
        if line.strip().startswith(name)
    }
    assert set(rows) == {"node b joins", "worker SIGKILL", "node b leaves"}, summary
    for name, match in rows.items():
        assert match, f"{name}: no recovery figures in {summary}"
        assert 0 < float(match.group(1)) < 60 and match.group(2) == "0", (
            f"{name}: {match.group(0)}\n{_node_logs(tmp_path / 'demo' / 'logs')}"
        )
    assert "training: finished, 300 steps committed (each once)" in done.stdout
    assert ", 0 seen twice within an epoch" in done.stdout
    assert "[demo] SIGKILL worker rank" in done.stdout and "resumed from" in done.stdout
    assert any((tmp_path / "demo" / "checkpoints").glob("ckpt-*.pt"))
    assert scraped, "node a's metrics endpoint never served training metrics"


def _node_logs(folder: Path) -> str:
    """The demo's node logs, heal and restart lines first, for a failure's message."""
    out = []
    for log in sorted(folder.glob("node-*.log")):
        lines = log.read_text(errors="replace").splitlines()
        out.append(f"--- {log.name}")
        out.extend(line for line in lines if "heal" in line or "elastic-trainer:" in line)
    return "\n".join(out)[-6000:]
