"""Run isolation with real etcd: a node of another job is refused the run id of a running job in
one line, touches nothing of it, and the running job finishes undisturbed; the same job passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_trainer.ops.processes import wait_for
from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints
from rendezvous.handler import create_handler
from rendezvous.job_identity import JobIdentity, RunIdInUseError, set_job_identity
from rendezvous.settings import DEFAULT_KEY_PREFIX
from tests.support.agents import agents as agents_cleanup
from tests.support.agents import start_torchrun

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).with_name("scripts") / "ddp_steps.py")
JOB_A = JobIdentity("train.py", False, ("--lr", "0.1"), 1, 1)
JOB_B = JobIdentity("train.py", False, ("--lr", "0.2"), 1, 1)


@pytest.fixture
def identity() -> Iterator[Any]:
    """Declare this process's job like ``elastic-trainer run`` does; forgotten afterwards."""
    yield set_job_identity
    set_job_identity(None)


def connect(endpoint: str) -> EtcdConnection:
    return EtcdConnection(EtcdClientConfig(endpoints=parse_endpoints(endpoint), retry_timeout=10))


def run_keys(endpoint: str, run_id: str) -> dict[str, int]:
    """Every key of the run with its mod revision: any write by anyone changes this."""
    connection = connect(endpoint)
    try:
        items = connection.call(
            lambda c: list(c.get_prefix(f"{DEFAULT_KEY_PREFIX}/{run_id}/")), what="a test read"
        )
    finally:
        connection.close()
    return {meta.key.decode(): meta.mod_revision for _, meta in items}


def read_key(endpoint: str, key: str) -> tuple[bytes | None, int]:
    connection = connect(endpoint)
    try:
        value, meta = connection.call(lambda c: c.get(key), what="a test read")
    finally:
        connection.close()
    return value, (meta.mod_revision if meta is not None else 0)


def test_another_job_is_refused_without_a_write_and_the_same_job_passes(
    etcd_server, unique_id: str, identity: Any
) -> None:
    def params() -> RendezvousParameters:
        return RendezvousParameters(
            "etcd-v3",
            etcd_server.endpoint,
            unique_id,
            1,
            1,
            retry_timeout="10",
            last_call_timeout="1",
        )

    identity(JOB_A)
    running = create_handler(params())
    try:
        running.next_rendezvous()
        before = run_keys(etcd_server.endpoint, unique_id)
        assert f"{DEFAULT_KEY_PREFIX}/{unique_id}/job" in before

        identity(JOB_B)
        with pytest.raises(RunIdInUseError) as raised:
            create_handler(params())
        message = str(raised.value)
        assert "\n" not in message
        assert message == (
            f"run id {unique_id!r} is in use by another job: it runs "
            f"'train.py --lr 0.1' with --nnodes 1:1, this node runs "
            f"'train.py --lr 0.2' with --nnodes 1:1; give this job its own run id "
            f"(--rdzv-id / --run-id)"
        )
        assert run_keys(etcd_server.endpoint, unique_id) == before  # the refused node wrote nothing
        assert not running.is_closed()

        identity(JOB_A)  # the same job, another node or a later restart: passes
        again = create_handler(params())
        assert again.get_run_id() == unique_id
    finally:
        running.shutdown()


def test_no_declared_identity_means_no_check(etcd_server, unique_id: str, identity: Any) -> None:
    identity(JOB_A)
    first = create_handler(RendezvousParameters("etcd-v3", etcd_server.endpoint, unique_id, 1, 1))
    identity(None)  # e.g. a custom launcher that says nothing about its job
    second = create_handler(RendezvousParameters("etcd-v3", etcd_server.endpoint, unique_id, 1, 1))
    assert second.get_run_id() == first.get_run_id()


def torchrun(endpoint: str, run_id: str, nnodes: str = "1:2") -> list[str]:
    return [
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--nnodes={nnodes}",
        "--nproc-per-node=2",
        "--max-restarts=3",
        "--monitor-interval=0.2",
        "--rdzv-conf=last_call_timeout=1,join_timeout=60,retry_timeout=10",
    ]


def test_a_second_job_with_the_same_run_id_is_refused_and_the_first_finishes_undisturbed(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    """The incident: a copy-pasted ``--rdzv-id`` let another script into a running job."""
    stop = tmp_path / "stop"  # job A trains until the refusals are checked (at most 800 steps)
    env = {
        "OUT_DIR": str(tmp_path),
        "STEPS": "800",
        "STEP_SLEEP_S": "0.05",
        "OMP_NUM_THREADS": "1",
        "STOP_FILE": str(stop),
    }
    others = {
        "other arguments": [*torchrun(etcd_server.endpoint, unique_id), SCRIPT, "--eval"],
        "another module": [
            *torchrun(etcd_server.endpoint, unique_id),
            "-m",
            "elastic_trainer.examples.synthetic_cnn",
        ],
        "other nnodes": [*torchrun(etcd_server.endpoint, unique_id, nnodes="1:3"), SCRIPT],
    }
    with agents_cleanup() as agents:
        job_a = start_torchrun(
            torchrun(etcd_server.endpoint, unique_id), [SCRIPT], tmp_path / "a.log", env
        )
        agents.append(job_a)
        wait_for(lambda: (tmp_path / "progress-0").exists(), timeout=120, what="job A to train")
        state_key = f"{DEFAULT_KEY_PREFIX}/{unique_id}/rdzv/state"
        state_before = read_key(etcd_server.endpoint, state_key)
        for case, argv in others.items():
            done = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", *argv],
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, **env},
            )
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            assert done.returncode == 2, f"{case}: {done.stderr[-3000:]}"
            assert len(lines) == 1 and "Traceback" not in done.stderr, (
                f"{case}: {done.stderr[-3000:]}"
            )
            assert lines[0].startswith(
                f"etcd-v3: error: run id {unique_id!r} is in use by another job: "
                f"it runs '{SCRIPT}' with --nnodes 1:2, this node runs "
            ), lines[0]
            assert job_a.poll() is None, f"job A ended while job B ({case}) was refused"
        assert (
            read_key(etcd_server.endpoint, state_key) == state_before
        )  # no round opened, nothing closed
        assert job_a.poll() is None, "job A ended before the refusals were checked"
        stop.touch()
        code = job_a.wait(180)
    assert code == 0, job_a.output()[-3000:]
    starts = (tmp_path / "starts").read_text().split()
    assert len(starts) == 2, job_a.output()[-3000:]  # its two workers started once: never restarted
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob(f"done-{unique_id}-*.json")]
    assert (result["attempt"], result["world_size"]) == (0, 2)
