"""Chaos suite fixtures: the no-fault reference runs, the random-schedule settings, markers.

The long random schedule (marker ``chaos_long``) is deselected unless asked for with
``-m chaos_long`` or ``CHAOS_LONG=1``; see README.md in this folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.faults import RunDirs
from tests.chaos.invariants import NoFaultRuns

CHAOS_SEED_ENV = "CHAOS_SEED"
CHAOS_FAULTS_ENV = "CHAOS_FAULTS"
CHAOS_LONG_ENV = "CHAOS_LONG"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos_long: the long seeded random fault schedule (opt-in)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = "chaos_long" in (config.option.markexpr or "") or os.environ.get(CHAOS_LONG_ENV) == "1"
    if wanted:
        return
    deselected = [item for item in items if item.get_closest_marker("chaos_long")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("chaos_long")]


@pytest.fixture(scope="session")
def no_fault(etcd_server, tmp_path_factory: pytest.TempPathFactory) -> NoFaultRuns:
    """The session's no-fault runs (each run once, shared by every scenario that needs it)."""
    return NoFaultRuns(endpoint=etcd_server.endpoint, tmp=tmp_path_factory)


@pytest.fixture
def chaos_seed() -> int:
    return int(os.environ.get(CHAOS_SEED_ENV, "7"))


@pytest.fixture
def chaos_faults() -> int:
    return int(os.environ.get(CHAOS_FAULTS_ENV, "20"))


@pytest.fixture
def run_dirs(tmp_path: Path) -> RunDirs:
    return RunDirs.under(tmp_path / "run")
