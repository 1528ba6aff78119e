"""The launcher-to-worker contract (:class:`LaunchContract`): one dataclass, written by the
launcher and read back by every worker, round trip included."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from elastic_trainer.runtime.errors import ConfigError
from elastic_trainer.runtime.settings import (
    ENV_HEAL,
    ENV_HEAL_JOIN,
    ENV_LAUNCHER_ID,
    ENV_NODE,
    HealSettings,
    LaunchContract,
    WorkerSettings,
)

FULL = LaunchContract(
    node="host-1234",
    reports_failures=True,
    metrics=True,
    metrics_dir="/tmp/metrics",
    heal=HealSettings(
        enabled=True,
        join=True,
        endpoint="127.0.0.1:2379,127.0.0.1:2380",
        rdzv_conf="protocol=https,ca_cert=/ca.pem",
        world=(2, 8),
        settle_s=0.25,
        timeout_s=30.0,
        marker="/tmp/heals/77",
    ),
    heartbeat_dir="/tmp/heartbeat",
    stopping_file="/tmp/warm/agent-stopping",
    launcher_id="4242-0123456789ab",
)


@pytest.mark.parametrize(
    "contract",
    [
        FULL,
        LaunchContract(),
        LaunchContract(node="n"),
        LaunchContract(heal=HealSettings()),
        LaunchContract(heal=HealSettings(enabled=True, endpoint="e:1")),
    ],
    ids=["full", "empty", "node-only", "heal-off", "heal-minimal"],
)
def test_round_trip(contract: LaunchContract) -> None:
    assert LaunchContract.from_environ(contract.to_environ()) == contract


def test_every_field_is_written_and_a_worker_reads_it() -> None:
    env = FULL.to_environ()
    names = set(env)
    assert all(
        name.startswith("ELASTIC_TRAINER_") or name == "PROMETHEUS_MULTIPROC_DIR" for name in names
    )
    assert {ENV_NODE, ENV_LAUNCHER_ID, ENV_HEAL, ENV_HEAL_JOIN} <= names
    settings = WorkerSettings.from_environ(env)
    assert (settings.node, settings.metrics, settings.metrics_dir) == (
        "host-1234",
        True,
        "/tmp/metrics",
    )
    assert settings.launcher_reports_failures and settings.heal == FULL.heal


def test_a_partial_contract_writes_only_its_own_fields() -> None:
    """The launcher writes what it knows at each stage; a later write must not clobber an earlier."""
    assert LaunchContract(heartbeat_dir="/hb").to_environ() == {
        "ELASTIC_TRAINER_HEARTBEAT_DIR": "/hb"
    }
    assert LaunchContract(reports_failures=True).to_environ() == {
        "ELASTIC_TRAINER_REPORTS_FAILURES": "1"
    }


def test_a_bad_value_names_its_variable() -> None:
    with pytest.raises(ConfigError, match="ELASTIC_TRAINER_HEAL_WORLD"):
        LaunchContract.from_environ(
            {
                ENV_HEAL: "in_place",
                "ELASTIC_TRAINER_HEAL_ENDPOINT": "e:1",
                "ELASTIC_TRAINER_HEAL_WORLD": "8:2",
            }
        )


def test_the_variable_names_are_written_in_one_place() -> None:
    """Every ``ELASTIC_TRAINER_*`` name the launcher and worker packages use is defined in
    runtime/settings.py (the CLI's own option variables are built from the option names)."""
    root = Path(__file__).resolve().parents[2] / "elastic_trainer"
    literal = re.compile(r"[\"']ELASTIC_TRAINER_[A-Z_]+[\"']")
    allowed = {
        root / "runtime" / "settings.py",
        root / "doctor" / "checks.py",
    }  # the doctor's fault switch
    offenders = [
        f"{path.relative_to(root)}: {match.group()}"
        for path in sorted(root.rglob("*.py"))
        if path not in allowed
        for match in literal.finditer(path.read_text())
    ]
    assert offenders == [], offenders


def test_launcher_tells_workers_through_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic_trainer.launch.plan import tell_workers

    monkeypatch.delenv("ELASTIC_TRAINER_HEARTBEAT_DIR", raising=False)
    take_back = tell_workers(LaunchContract(heartbeat_dir="/hb"))
    assert os.environ["ELASTIC_TRAINER_HEARTBEAT_DIR"] == "/hb"
    take_back()
    assert "ELASTIC_TRAINER_HEARTBEAT_DIR" not in os.environ
