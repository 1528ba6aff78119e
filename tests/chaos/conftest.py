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


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("chaos", "chaos suite (tests/chaos/README.md)")
    group.addoption(
        "--chaos-seed",
        type=int,
        default=None,
        help=f"random fault schedule seed (env {CHAOS_SEED_ENV})",
    )
    group.addoption(
        "--chaos-faults",
        type=int,
        default=None,
        help=f"faults in the long random schedule (env {CHAOS_FAULTS_ENV}, default 20)",
    )


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


def _setting(config: pytest.Config, option: str, env: str, default: int) -> int:
    # The option exists only when pytest starts in tests/chaos (pytest reads options from the
    # conftest files of the paths it is given); the environment variable works from anywhere.
    value = config.getoption(option, default=None)
    if value is None:
        raw = os.environ.get(env, "").strip()
        try:
            value = int(raw) if raw else default
        except ValueError:
            raise pytest.UsageError(f"{env}={raw!r}: must be an integer") from None
    return int(value)


@pytest.fixture
def chaos_seed(request: pytest.FixtureRequest) -> int:
    """Seed of the random fault schedule: ``--chaos-seed`` or ``CHAOS_SEED`` (default 7)."""
    return _setting(request.config, "chaos_seed", CHAOS_SEED_ENV, 7)


@pytest.fixture
def chaos_faults(request: pytest.FixtureRequest) -> int:
    """Faults in the long schedule: ``--chaos-faults`` or ``CHAOS_FAULTS`` (default 20)."""
    return _setting(request.config, "chaos_faults", CHAOS_FAULTS_ENV, 20)


@pytest.fixture
def run_dirs(tmp_path: Path) -> RunDirs:
    return RunDirs.under(tmp_path / "run")
