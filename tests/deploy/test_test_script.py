"""scripts/test.sh sets up what pip cannot (Prometheus with promtool, openssl) or says in one line
what is missing; .ci/run is that same command with CI=true.

The checks run the real script (`--check-system-tools`: only the system-tool step) with a PATH
that holds just the tools each case allows, so no package is installed or removed here.

    pytest tests/deploy/test_test_script.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO

pytestmark = pytest.mark.timeout(60)

TEST_SH = REPO / "scripts" / "test.sh"
CI_RUN = REPO / ".ci" / "run"
BASH = shutil.which("bash") or "/bin/bash"


def check_tools(
    tmp_path: Path, allowed: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `scripts/test.sh --check-system-tools` with only ``allowed`` commands on PATH (and no
    apt-get or sudo, so nothing can be installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ["dirname", *allowed]:
        found = shutil.which(name)
        if found is None:
            pytest.skip(f"{name} is not installed")
        (bin_dir / name).symlink_to(found)
    return subprocess.run(
        [BASH, str(TEST_SH), "--check-system-tools"],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path), **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )


def real_binary(name: str, env_var: str) -> str:
    path = os.environ.get(env_var) or shutil.which(name) or f"/usr/bin/{name}"
    if not os.access(path, os.X_OK):
        pytest.skip(f"{name} is not installed")
    return path


def test_nothing_to_install_when_every_tool_is_there(tmp_path: Path) -> None:
    env = {
        "PROMETHEUS_BIN": real_binary("prometheus", "PROMETHEUS_BIN"),
        "PROMTOOL_BIN": real_binary("promtool", "PROMTOOL_BIN"),
    }
    proc = check_tools(tmp_path, ["openssl"], env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


@pytest.mark.parametrize(
    ("allowed", "missing"),
    [
        pytest.param(["openssl"], "prometheus", id="prometheus"),
        pytest.param([], "prometheus openssl", id="prometheus and openssl"),
    ],
)
def test_a_tool_it_cannot_install_is_named_in_one_line(
    tmp_path: Path, allowed: list[str], missing: str
) -> None:
    """No apt-get (as root) or not root without sudo: exit 1 and one line naming the package(s)
    and how to install them, never a traceback or a test run that silently skips."""
    proc = check_tools(tmp_path, allowed)
    assert proc.returncode == 1
    assert proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"scripts/test.sh: missing {missing} and ")
    assert "install" in line


def test_promtool_alone_missing_is_the_prometheus_package(tmp_path: Path) -> None:
    """promtool ships in the Debian package prometheus."""
    env = {"PROMETHEUS_BIN": real_binary("prometheus", "PROMETHEUS_BIN")}
    proc = check_tools(tmp_path, ["openssl"], env)
    assert proc.returncode == 1
    assert proc.stderr.startswith("scripts/test.sh: missing prometheus and ")


def test_ci_runs_the_readme_command_with_ci_true() -> None:
    lines = [
        line.strip()
        for line in CI_RUN.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert 'export CI="${CI:-true}"' in lines
    assert lines[-1] == "exec bash scripts/test.sh"
    assert not any("apt-get" in line for line in lines), "scripts/test.sh installs the tools"


def test_busy_processes_spin_for_the_run_and_stop_with_it(tmp_path: Path) -> None:
    """`--busy 2` starts two CPU-bound processes and stops them when the script ends (here the
    system-tool step alone, with every tool present, so nothing is installed)."""
    pids_file = tmp_path / "busy.pids"
    env = {
        **os.environ,
        "PROMETHEUS_BIN": real_binary("prometheus", "PROMETHEUS_BIN"),
        "PROMTOOL_BIN": real_binary("promtool", "PROMTOOL_BIN"),
        "BUSY_PIDS_FILE": str(pids_file),
    }
    done = subprocess.run(
        [BASH, str(TEST_SH), "--busy", "2", "--check-system-tools"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2 and "2 busy process(es)" in done.stderr
    for pid in pids:  # gone with the script (a zombie would still have a /proc entry)
        assert not Path(f"/proc/{pid}").exists()


def test_busy_takes_a_number(tmp_path: Path) -> None:
    done = subprocess.run(
        [BASH, str(TEST_SH), "--busy", "two"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "scripts/test.sh: --busy takes a number of busy processes, got 'two'"
    ]
