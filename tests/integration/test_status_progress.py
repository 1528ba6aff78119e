"""Progress in ``status``: a ProgressPublisher over a real launcher registry, read back from a real etcd.

The node endpoint is the launcher's (``start_launcher_metrics``) with a real worker process
writing steps through ``worker_observer()`` into the multiprocess directory, exactly as under
``elastic-trainer run``; the publisher reads that registry and writes to the session's etcd;
``read_status`` (what ``elastic-trainer status`` prints) reads it back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_trainer.launch.node_metrics import (
    LauncherMetrics,
    LauncherMetricsConfig,
    start_launcher_metrics,
)
from elastic_trainer.launch.progress_publisher import ProgressKeys, ProgressPublisher
from elastic_trainer.metrics.worker import PrometheusObserver, WorkerLabels
from elastic_trainer.ops.processes import wait_for, worker_processes
from elastic_trainer.ops.status import read_status, render_status
from rendezvous.etcd_client import EtcdConnection
from rendezvous.etcd_server import EtcdServer, free_port
from rendezvous.settings import parse_settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# A training worker in miniature: the real observer in multiprocess mode, stepping until killed.
WORKER = """
import time
from elastic_trainer.metrics.worker import worker_observer
obs = worker_observer()
obs.on_start(world_size=2, restart_count=0, total_steps=100000)
for step in range(1, 100000):
    obs.on_step(step=step, duration_s=0.02, data_wait_s=0.0, samples=32, tokens=0, loss=1.0 / step, lr=0.01)
    time.sleep(0.02)
"""


@contextlib.contextmanager
def launcher_metrics(tmp_path: Path, run_id: str) -> Iterator[LauncherMetrics]:
    config = LauncherMetricsConfig(addr="127.0.0.1", port=0, run_id=run_id, node="host-a-101",
                                   multiproc_dir=str(tmp_path / "multiproc"))  # fmt: skip
    with start_launcher_metrics(config) as metrics:
        yield metrics


@contextlib.contextmanager
def worker(rank: int, run_id: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        TORCHELASTIC_RUN_ID=run_id,
        OMP_NUM_THREADS="1",
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER], env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            yield proc
        finally:
            proc.kill()
            proc.wait(timeout=30)


def status(etcd: EtcdServer, run_id: str) -> dict:
    return read_status(etcd.endpoint, run_id, {"retry_timeout": "5"}, None)


def test_status_shows_the_progress_rank_0_publishes_and_the_last_error(
    tmp_path: Path, etcd_server: EtcdServer, unique_id: str
) -> None:
    params = RendezvousParameters("etcd-v3", etcd_server.endpoint, unique_id, 1, 1, ttl="600")
    with (
        launcher_metrics(tmp_path, unique_id) as metrics,
        worker(0, unique_id, tmp_path / "worker.log") as proc,
    ):
        publisher = ProgressPublisher.from_params(params, metrics, interval_s=1.0)
        publisher.start()
        try:

            def progressed() -> dict | None:
                assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
                p = status(etcd_server, unique_id)["progress"]
                return p if p and p["step"] and p["steps_per_s"] else None

            progress = wait_for(progressed, timeout=90, what="rank 0's node to publish progress with a rate",
                                interval=0.2)  # fmt: skip
            assert progress["total_steps"] == 100000 and progress["world_size"] == 2
            assert progress["published_by"] == "host-a-101" and progress["lr"] == 0.01
            assert 0 < progress["step"] < 100000 and progress["steps_per_s"] > 0
            assert progress["eta_s"] == pytest.approx(
                (100000 - progress["step"]) / progress["steps_per_s"], rel=0.01
            )
            # One of the two ranks is seen: the job's throughput is scaled from it.
            assert progress["samples_per_s"] == pytest.approx(
                2 * 32 * progress["steps_per_s"], rel=0.01
            )
            assert progress["last_step_age_s"] is not None and progress["restarts"] == 0

            # Any node may report an error: one line, read back by status.
            publisher.publish_error(
                "worker rank 1 (pid 77) exited with signal 9 (SIGKILL)\nTraceback ..."
            )
            error = wait_for(lambda: status(etcd_server, unique_id)["last_error"], timeout=30, what="the error in etcd",
                             interval=0.2)  # fmt: skip
            assert error["text"] == "worker rank 1 (pid 77) exited with signal 9 (SIGKILL)"
            assert error["node"] == "host-a-101"

            report = status(etcd_server, unique_id)
            assert report["found"] is False  # no rendezvous in this test: progress stands alone
            text = render_status(report)
            assert f"progress: step {report['progress']['step']} / 100000" in text
            assert (
                "last error: worker rank 1 (pid 77) exited with signal 9 (SIGKILL) (host-a-101, "
                in text
            )

            # A node without global rank 0 reads its registry but writes nothing.
            other = CollectorRegistry()
            observer = PrometheusObserver(labels=WorkerLabels(run_id=unique_id, node="host-b-202", rank=1, local_rank=0),
                                          registry=other, flush_interval_s=0.0)  # fmt: skip
            observer.on_step(
                step=10**6, duration_s=0.1, data_wait_s=0.0, samples=32, tokens=0, loss=None
            )
            quiet = ProgressPublisher(EtcdConnection(parse_settings(params).client_config()), ProgressKeys.from_params(params),
                                      other, node="host-b-202", interval_s=1.0, owns_connection=True)  # fmt: skip
            try:
                assert quiet.publish_once() is None
            finally:
                quiet.close()
            assert status(etcd_server, unique_id)["progress"]["published_by"] == "host-a-101"
        finally:
            publisher.close()

    # The publisher stopped: its progress key expires with its lease (3 intervals); the error stays.
    wait_for(lambda: status(etcd_server, unique_id)["progress"] is None, timeout=30, what="the progress key to expire",
             interval=0.2)  # fmt: skip
    assert status(etcd_server, unique_id)["last_error"] is not None


def test_an_unreachable_etcd_never_blocks_the_launcher(
    tmp_path: Path, unique_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Writes fail within the interval's budget; the thread logs once and keeps trying; close() returns."""
    params = RendezvousParameters("etcd-v3", f"127.0.0.1:{free_port()}", unique_id, 1, 1,
                                  retry_timeout="1", read_timeout="1")  # fmt: skip
    with (
        launcher_metrics(tmp_path, unique_id) as metrics,
        worker(0, unique_id, tmp_path / "worker.log"),
    ):
        publisher = ProgressPublisher.from_params(params, metrics, interval_s=0.5)
        try:

            def has_step() -> bool:
                return (
                    metrics.registry.get_sample_value(
                        "elastic_trainer_step",
                        {"run_id": unique_id, "node": "host-a-101", "rank": "0", "local_rank": "0"},
                    )
                    is not None
                )

            wait_for(has_step, timeout=90, what="the worker's first step", interval=0.2)
            with pytest.raises(RendezvousConnectionError):
                publisher.publish_once()
            publisher.publish_error("an error nobody can store")
            with caplog.at_level(logging.WARNING):
                publisher.start()
                wait_for(lambda: [r for r in caplog.records if "progress publisher" in r.getMessage()], timeout=30,
                         what="a warning", interval=0.2)  # fmt: skip
        finally:
            publisher.close(timeout_s=5.0)
    messages = [
        r.getMessage()
        for r in caplog.records
        if r.name == "elastic_trainer.launch.progress_publisher"
    ]
    assert sum("retrying every" in m for m in messages) == 1, (
        messages
    )  # once per outage, not per attempt
    # The etcd client's per-retry warnings from the publisher's thread are left out too.
    assert not [
        r
        for r in caplog.records
        if r.name == "rendezvous.etcd_client" and r.threadName == "progress-publisher"
    ]


@pytest.mark.parametrize("heal", ["in_place", "off"])
def test_a_real_run_publishes_progress_and_its_last_error(
    tmp_path: Path, etcd_server: EtcdServer, unique_id: str, heal: str
) -> None:
    """``elastic-trainer run`` (two gloo workers on the session's etcd): ``status`` shows the
    progress rank 0's launcher publishes, under the name its metrics carry; a killed worker's
    root cause becomes the last error, and the heal (in place) or the restart (``--heal off``)
    shows in the progress. The progress is published every second instead of every 10 s: the
    waits below are for records, and the records' content does not depend on their pace."""
    port = free_port()
    cli = [sys.executable, "-m", "elastic_trainer.cli"]
    with open(tmp_path / "run.log", "wb") as log:
        job = subprocess.Popen(
            [*cli, "run", "--rdzv-endpoint", etcd_server.endpoint, "--run-id", unique_id, "--nproc-per-node", "2",
             "--metrics-addr", "127.0.0.1", "--metrics-port", str(port), "--max-restarts", "2",
             "--heal", heal, "--progress-interval", "1", "-m", "elastic_trainer.examples.synthetic_cnn", "--max-steps", "100000", "--epochs", "10000",
             "--throttle-ms", "40", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "50"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
        )  # fmt: skip
        try:

            def status_json() -> dict:
                """What ``elastic-trainer status --json`` prints, from a real CLI process (about
                2 s of CPU each: the waits below poll in process, ``polled``, and this checks
                the CLI once the run has shown everything)."""
                done = subprocess.run([*cli, "status", "--rdzv-endpoint", etcd_server.endpoint, "--run-id", unique_id,
                                       "--json"], capture_output=True, text=True, timeout=60)  # fmt: skip
                assert done.returncode == 0, done.stderr
                return json.loads(done.stdout)

            def polled() -> dict:
                """The CLI's report (``read_status`` with its default retry_timeout) as JSON."""
                return json.loads(json.dumps(status(etcd_server, unique_id)))

            def with_rate() -> dict | None:
                assert job.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
                report = polled()
                p = report.get("progress")
                return report if p and p["steps_per_s"] and report["found"] else None

            report = wait_for(
                with_rate, timeout=150, what="progress with a rate in status", interval=0.2
            )
            progress = report["progress"]
            assert progress["total_steps"] == 100000 and progress["world_size"] == 2
            assert (
                progress["eta_s"] > 0
                and progress["samples_per_s"] > 0
                and progress["lr"] is not None
            )
            (participant,) = report["participants"]
            assert participant["pid"] == job.pid and progress["published_by"] == participant["name"]
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
                .read()
                .decode()
            )
            assert f'node="{participant["name"]}"' in text

            os.kill(worker_processes(job.pid)[-1], signal.SIGKILL)
            error = wait_for(lambda: polled()["last_error"], timeout=120, what="the root cause in status",
                             interval=0.2)  # fmt: skip
            assert "SIGKILL" in error["text"] and error["node"] == participant["name"]
            counted = "heals" if heal == "in_place" else "restarts"
            if heal == "in_place":
                assert "healed in place" in error["text"], error
            progress = wait_for(lambda: (p := polled()["progress"]) is not None and (p[counted] or 0) >= 1 and p,
                                timeout=150, what=f"the {counted} in the progress", interval=0.2)  # fmt: skip
            assert progress["restarts" if heal == "in_place" else "heals"] == 0, (
                progress
            )  # one kind, not both
            # The CLI prints the same: the run, the root cause and the heal or restart.
            shown = status_json()
            assert shown["found"] and shown["progress"]["total_steps"] == 100000, shown
            assert shown["last_error"]["text"] == error["text"], shown
            assert (shown["progress"][counted] or 0) >= 1, shown
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGTERM)
                try:
                    job.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait(30)
