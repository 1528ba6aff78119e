"""Real torchrun agents and gloo workers rendezvousing through ``--rdzv-backend=etcd-v3``."""

from __future__ import annotations

import json
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from elastic_trainer.ops.processes import wait_for
from tests.support.agents import Agent, start_torchrun
from tests.support.agents import agents as agents_cleanup

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).with_name("scripts") / "ddp_steps.py")
FAST_RDZV = "last_call_timeout=1,join_timeout=60,retry_timeout=10"


def torchrun_args(endpoint: str, run_id: str, nnodes: str = "1:2", nproc: int = 2) -> list[str]:
    return [
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--max-restarts=3",
        "--monitor-interval=0.2",
        f"--rdzv-conf={FAST_RDZV}",
    ]


def results(out: Path, run_id: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"done-{run_id}-*.json"))]


def start(
    agents: list[Agent],
    tmp_path: Path,
    endpoint: str,
    run_id: str,
    name: str,
    env: dict[str, str],
    **kw,
) -> Agent:  # type: ignore[no-untyped-def]
    agent = start_torchrun(
        torchrun_args(endpoint, run_id, **kw), [SCRIPT], tmp_path / f"{name}.log", env
    )
    agents.append(agent)
    return agent


def test_entry_point_resolves_to_the_handler_factory() -> None:
    from rendezvous.plugin import create_rdzv_handler

    (entry,) = [e for e in entry_points(group="torchrun.handlers") if e.name == "etcd-v3"]
    assert entry.load()() is create_rdzv_handler


@pytest.mark.parametrize(
    "first_import", ["rendezvous.handler", "rendezvous", "torch.distributed.run"]
)
def test_torch_registers_etcd_v3_whatever_is_imported_first(first_import: str) -> None:
    """A fresh interpreter: torch only *warns* when a plugin fails, so check stderr too."""
    import subprocess
    import sys

    code = (
        f"import {first_import}\n"
        "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r\n"
        "from rendezvous.plugin import create_rdzv_handler, ensure_registered\n"
        "assert r._registry['etcd-v3'] is create_rdzv_handler\n"
        "ensure_registered()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Exception while registering" not in done.stderr


def test_two_agents_train_together(etcd_server, tmp_path: Path, unique_id: str) -> None:
    env = {"OUT_DIR": str(tmp_path), "STEPS": "10"}
    with agents_cleanup() as agents:
        for name in ("a", "b"):
            start(agents, tmp_path, etcd_server.endpoint, unique_id, name, env)
        codes = [a.wait(120) for a in agents]
    assert codes == [0, 0], agents[0].output()[-3000:]
    (result,) = results(tmp_path, unique_id)
    assert result["world_size"] == 4 and result["rank_sum"] == 6.0
    # The agents tell their workers the store is new every round (no c10d shared-store warning).
    assert result["rdzv_backend_env"] == "etcd-v3"


def test_worker_sigkill_restarts_the_group(etcd_server, tmp_path: Path, unique_id: str) -> None:
    env = {"OUT_DIR": str(tmp_path), "STEPS": "30", "DIE_AT_STEP": "8", "DIE_RANK": "3"}
    with agents_cleanup() as agents:
        for name in ("a", "b"):
            start(agents, tmp_path, etcd_server.endpoint, unique_id, name, env)
        codes = [a.wait(150) for a in agents]
    assert (tmp_path / "died").exists()
    assert codes == [0, 0], agents[1].output()[-3000:]
    # All four workers started exactly twice: the kill's restart and nothing after the group
    # finished (a finished worker that aborts in interpreter teardown would add a round; see
    # scripts/ddp_steps.py).
    starts = len((tmp_path / "starts").read_text().split())
    assert starts == 8, (
        f"{starts} worker starts\n" + agents[0].output()[-3000:] + agents[1].output()[-3000:]
    )
    (result,) = results(tmp_path, unique_id)
    assert result["world_size"] == 4


def worlds_training(out: Path) -> set[int]:
    """The world sizes the nodes' workers last wrote in ``progress-*`` (scripts/ddp_steps.py)."""
    worlds = set()
    for path in out.glob("progress-*"):
        fields = path.read_text().split()
        if len(fields) == 2:  # not caught halfway through a write
            worlds.add(int(fields[1]))
    return worlds


def test_lost_agent_the_survivor_re_rendezvouses(
    etcd_server, tmp_path: Path, unique_id: str
) -> None:
    # The survivor's new group stops (STOP_FILE) once it trains, instead of running out its 150
    # steps: the new round is what this test is about.
    stop = tmp_path / "stop"
    env = {"OUT_DIR": str(tmp_path), "STEPS": "150", "STEP_SLEEP_S": "0.1", "STOP_FILE": str(stop)}
    with agents_cleanup() as agents:
        survivor = start(agents, tmp_path, etcd_server.endpoint, unique_id, "a", env)
        doomed = start(agents, tmp_path, etcd_server.endpoint, unique_id, "b", env)
        wait_for(lambda: any(tmp_path.glob("progress-*")), timeout=90, what="training to start")
        doomed.kill_node()
        for path in tmp_path.glob("progress-*"):
            path.unlink()  # from here on, only steps taken after the loss
        wait_for(lambda: 2 in worlds_training(tmp_path), timeout=120, what="the survivor alone training",
                 describe=lambda: survivor.tail())  # fmt: skip
        stop.touch()
        code = survivor.wait(180)
    assert code == 0, survivor.output()[-3000:]
    final = results(tmp_path, unique_id)[-1]
    assert final["world_size"] == 2, final


def test_late_joiner_gets_a_fresh_store_address(
    etcd_server, tmp_path: Path, unique_id: str
) -> None:
    """Regression for torch 2.13's cached shared TCPStore (shared/notes quirk 1): the first agent
    trains alone, the second arrives seconds later; both must re-rendezvous and finish."""
    # Both stop (STOP_FILE) once the group of four trains, instead of running out the 80 steps.
    stop = tmp_path / "stop"
    env = {"OUT_DIR": str(tmp_path), "STEPS": "80", "STEP_SLEEP_S": "0.1", "STOP_FILE": str(stop)}
    with agents_cleanup() as agents:
        first = start(agents, tmp_path, etcd_server.endpoint, unique_id, "a", env)
        wait_for(
            lambda: (tmp_path / "progress-0").exists(),
            timeout=90,
            what="the first agent to train alone",
        )
        time.sleep(2)
        second = start(agents, tmp_path, etcd_server.endpoint, unique_id, "b", env)
        wait_for(lambda: 4 in worlds_training(tmp_path), timeout=120, what="both agents training",
                 describe=lambda: first.tail() + second.tail())  # fmt: skip
        stop.touch()
        codes = [first.wait(150), second.wait(150)]
    assert codes == [0, 0], first.output()[-3000:]
    assert results(tmp_path, unique_id)[-1]["world_size"] == 4


def test_two_run_ids_on_one_etcd_do_not_interfere(
    etcd_server, tmp_path: Path, unique_id: str
) -> None:
    env = {"OUT_DIR": str(tmp_path), "STEPS": "10"}
    with agents_cleanup() as agents:
        for run in ("x", "y"):
            for name in ("a", "b"):
                # fixed size: one round per run, so any cross-talk shows up as a wrong world size
                start(
                    agents,
                    tmp_path,
                    etcd_server.endpoint,
                    f"{unique_id}-{run}",
                    f"{run}{name}",
                    env,
                    nnodes="2",
                    nproc=1,
                )
        codes = [a.wait(150) for a in agents]
    assert codes == [0, 0, 0, 0]
    for run in ("x", "y"):
        (result,) = results(tmp_path, f"{unique_id}-{run}")
        assert result["world_size"] == 2 and result["run_id"] == f"{unique_id}-{run}"


@pytest.mark.parametrize(
    ("conf", "line"),
    [
        (
            "read_timout=5",
            "etcd-v3: error: rdzv-conf: unknown key 'read_timout' (did you mean 'read_timeout'?); "
            "known keys: read_timeout, retry_timeout, ",
        ),
        (
            "handlr=lease",
            "etcd-v3: error: rdzv-conf: unknown key 'handlr' (did you mean 'handler'?); known keys: ",
        ),
        ("bogus=1", "etcd-v3: error: rdzv-conf: unknown key 'bogus'; known keys: "),
        ("read_timeout=abc", "etcd-v3: error: rdzv-conf read_timeout: 'abc' is not a number"),
        (
            "handler=dynamic",
            "etcd-v3: error: rdzv-conf handler: 'dynamic' (torch's dynamic rendezvous) was "
            "retired; omit handler to use the lease handler",
        ),
        ("join_timeout=0", "etcd-v3: error: rdzv-conf join_timeout: must be > 0, got 0"),
    ],
)
def test_a_bad_rdzv_conf_under_plain_torchrun_is_one_line_and_exit_2(
    etcd_server, tmp_path: Path, unique_id: str, conf: str, line: str
) -> None:
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--rdzv-backend=etcd-v3",
            f"--rdzv-endpoint={etcd_server.endpoint}",
            f"--rdzv-id={unique_id}",
            "--nnodes=1",
            f"--rdzv-conf={conf}",
            SCRIPT,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"},
    )
    lines = [text for text in done.stderr.splitlines() if text.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(line), lines[0]
    assert not (tmp_path / "starts").exists()
