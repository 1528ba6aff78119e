"""The README's standalone etcd commands, as written, on loopback: one node, then a three-member
cluster (members on 127.0.0.1-3, free ports) that `elastic-trainer run` trains against."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints
from rendezvous.etcd_server import find_etcd_binary, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]


def _etcd_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = [
        b
        for b in re.findall(r"```bash\n(.*?)```", text, re.S)
        if b.lstrip().startswith("etcd --name")
    ]
    assert len(blocks) == 2, "the README shows one etcd node and a three-member cluster"
    return [b.replace("\\\n", " ") for b in blocks]


def _argv(block: str, values: dict[str, str], client: int, peer: int, data: Path) -> list[str]:
    line = block.strip()
    for name, value in values.items():
        line = line.replace(f"${name}", value)
    # On one machine every member listens on its own loopback address and free ports.
    line = (
        line.replace("0.0.0.0", values["HOST_IP"])
        .replace(":2379", f":{client}")
        .replace(":2380", f":{peer}")
    )
    line = re.sub(r"/var/lib/\S+", str(data), line)
    argv = shlex.split(line)
    assert argv[0] == "etcd" and "$" not in line, line
    return [find_etcd_binary(), *argv[1:]]


def _healthy(endpoints: str, timeout: float = 30.0) -> None:
    connection = EtcdConnection(
        EtcdClientConfig(endpoints=parse_endpoints(endpoints), retry_timeout=timeout)
    )
    try:
        connection.check()
        connection.call(lambda c: c.put("/readme/check", b"ok"), what="a put")
        assert connection.call(lambda c: c.get("/readme/check"), what="a get")[0] == b"ok"
    finally:
        connection.close()


@contextlib.contextmanager
def _started(argvs: list[list[str]], tmp: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = []
    try:
        for i, argv in enumerate(argvs):
            log = open(tmp / f"etcd-{i}.log", "wb")  # noqa: SIM115 - closed with the test's tmp dir
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def test_one_etcd_node(tmp_path: Path) -> None:
    single, _ = _etcd_blocks()
    client, peer = free_port(), free_port()
    argv = _argv(single, {"HOST_IP": "127.0.0.1"}, client, peer, tmp_path / "data")
    with _started([argv], tmp_path) as procs:
        _healthy(f"127.0.0.1:{client}")
        assert procs[0].poll() is None


def test_three_member_cluster_trains_a_job(tmp_path: Path) -> None:
    _, cluster = _etcd_blocks()
    ips = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    client, peer = free_port(), free_port()
    argvs = [
        _argv(
            cluster,
            {"NAME": f"etcd-{i}", "HOST_IP": ip, "IP0": ips[0], "IP1": ips[1], "IP2": ips[2]},
            client,
            peer,
            tmp_path / f"data-{i}",
        )
        for i, ip in enumerate(ips)
    ]
    endpoints = ",".join(f"{ip}:{client}" for ip in ips)
    with _started(argvs, tmp_path) as procs:
        _healthy(endpoints)
        started = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "elastic_trainer.cli",
                "run",
                "--rdzv-endpoint",
                endpoints,
                "--run-id",
                "job-42",
                "--nnodes",
                "1:2",
                "--nproc-per-node",
                "2",
                "--metrics-port",
                "0",
                "-m",
                "elastic_trainer.examples.synthetic_cnn",
                "--max-steps",
                "5",
                "--checkpoint-dir",
                str(tmp_path / "c"),
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "training finished at step 5" in done.stderr
        print(f"trained against the 3-member cluster in {time.monotonic() - started:.1f} s")
        assert all(proc.poll() is None for proc in procs), "every member still up"
