"""Chaos suite fixtures: the no-fault reference runs, the random-schedule settings, markers.

The long random schedule (marker ``chaos_long``) is deselected unless asked for with
``-m chaos_long`` or ``CHAOS_LONG=1``; see README.md in this folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.chaos.faults import JobSpec, RunDirs, start_node, unique_run_id, wait_all

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
def reference_runs(etcd_server, tmp_path_factory: pytest.TempPathFactory) -> Callable[[JobSpec, int], RunDirs]:
    """``reference(job, world_size)``: the finished no-fault run of ``job`` on one node with
    ``world_size`` workers, run once per session and shared by every scenario that needs it."""
    done: dict[tuple[JobSpec, int], RunDirs] = {}

    def reference(job: JobSpec, world_size: int) -> RunDirs:
        key = (job, world_size)
        if key not in done:
            run = RunDirs.under(tmp_path_factory.mktemp(f"reference-w{world_size}"))
            node = start_node(name="ref", run=run, job=job, endpoint=etcd_server.endpoint,
                              run_id=unique_run_id("reference"), nnodes="1", nproc_per_node=world_size,
                              max_restarts=0)
            try:
                codes = wait_all([node], timeout=180)
                assert codes == {node.log_path.name: 0}, f"the reference run failed: {codes}\n{node.tail()}"
            finally:
                node.stop()
            done[key] = run
        return done[key]

    return reference


@pytest.fixture
def chaos_seed() -> int:
    return int(os.environ.get(CHAOS_SEED_ENV, "7"))


@pytest.fixture
def chaos_faults() -> int:
    return int(os.environ.get(CHAOS_FAULTS_ENV, "20"))


@pytest.fixture
def run_dirs(tmp_path: Path) -> RunDirs:
    return RunDirs.under(tmp_path / "run")
