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


def test_first_command_trains_elastically_with_metrics(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "METRICS_PORT": str(port), "CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    scraped: list[str] = []

    def scrape() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not scraped:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                    text = response.read().decode()
                if "elastic_trainer_samples_total" in text:
                    scraped.append(text)
            except OSError:
                pass
            time.sleep(0.5)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    done = subprocess.run(readme_commands()[0].split(), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    scraper.join(5)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training finished" in done.stderr + done.stdout
    assert any((tmp_path / "ckpt").glob("ckpt-*.pt"))
    assert scraped, "the node's metrics endpoint never served training metrics"
