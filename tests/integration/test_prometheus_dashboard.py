"""A real Prometheus scrapes a real two-worker torchrun job; every dashboard query returns data.

The job is the runtime's example (``elastic_trainer.examples.synthetic_cnn``). The launcher is a
small wrapper that does what ``elastic-trainer run`` does: it calls ``start_launcher_metrics``
and then ``torch.distributed.run.main`` in-process, so the node endpoint lives in the agent's
process and survives worker restarts. The test SIGKILLs one
worker mid-run and checks that the endpoint kept answering, counters kept rising (also through
Prometheus' ``resets()``), the one restart count went up, and the ``node`` label is the name
``elastic-trainer status`` gives the node from the rendezvous.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_trainer.ops.processes import NodeProcess, start_process, wait_for
from elastic_trainer.ops.status import read_status
from rendezvous.etcd_server import EtcdServer, free_port
from tests.support.prometheus_server import prometheus_server, require_binary
from tests.unit.test_metrics_dashboard import (
    dashboard_expressions,
    load_dashboard,
    variable_queries,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LAUNCHER = """
import sys
import torch.distributed.run as torchrun
from elastic_trainer.launch.node_metrics import LauncherMetricsConfig, start_launcher_metrics

port, run_id, multiproc_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
config = LauncherMetricsConfig(addr="127.0.0.1", port=port, run_id=run_id, multiproc_dir=multiproc_dir)
with start_launcher_metrics(config):
    torchrun.main(sys.argv[4:])
"""

# The runtime's example job: ELASTIC_TRAINER_METRICS=1 (set by the launcher) makes it report
# through elastic_trainer.metrics.worker.worker_observer(). ~30 ms per step on 2 CPU cores.
# 500 steps: the worker is killed once a checkpoint of step 50 or later is out, and the test
# waits for 25 steps more after the restart; the rest is the end of the run that the test waits
# for (it was 1000 steps: ~15 s more of the same), Prometheus scraping every second throughout.
JOB_ARGS = [
    "-m", "elastic_trainer.examples.synthetic_cnn",
    "--max-steps", "500", "--epochs", "1000", "--global-batch-size", "128", "--width", "32",
    "--dataset-size", "4096", "--checkpoint-every", "25", "--log-every", "100", "--seed", "0",
]  # fmt: skip


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def total(text: str, name: str) -> float:
    return sum(v for n, _, v in samples(text) if n == name)


def values(text: str, name: str) -> list[float]:
    return [v for n, _, v in samples(text) if n == name]


@dataclass
class Poller:
    """Scrapes the endpoint in the background: the endpoint must answer across restarts."""

    url: str
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    samples_seen: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                text = scrape(self.url)
            except OSError as exc:
                if not self._stop.is_set():
                    self.failures.append(str(exc))
                continue
            self.ok += 1
            self.samples_seen.append(total(text, "elastic_trainer_samples_total"))

    def stop(self) -> None:
        self._stop.set()


ONLY_WITH_A_HEAL = {"annotation Heals"}
"""Marks in-place heals, which this plain-torchrun run has none of (restarts only): checked to be
valid PromQL here, not to have data."""


@contextlib.contextmanager
def launcher(tmp_path: Path, etcd: EtcdServer, run_id: str, port: int) -> Iterator[NodeProcess]:
    """The wrapper launcher (see the module docstring); nothing of it survives the test."""
    torchrun_args = [
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={run_id}",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=2",
        "--monitor-interval=0.2",
        "--rdzv-conf=last_call_timeout=1,join_timeout=60,retry_timeout=10",
    ]
    cmd = [sys.executable, "-c", LAUNCHER, str(port), run_id, str(tmp_path / "multiproc"),
           *torchrun_args, *JOB_ARGS, "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
    with start_process(
        cmd, tmp_path / "launcher.log", {**os.environ, "OMP_NUM_THREADS": "1"}
    ) as node:
        yield node


def finite_points(result: list[dict]) -> int:
    return sum(1 for series in result for _, v in series["values"] if math.isfinite(float(v)))


def test_dashboard_shows_data_from_a_real_run_across_a_worker_restart(
    tmp_path: Path, etcd_server: EtcdServer, unique_id: str
) -> None:
    promtool = require_binary("promtool", "PROMTOOL_BIN")
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    started = time.time()
    with (
        launcher(tmp_path, etcd_server, unique_id, port) as proc,
        prometheus_server(tmp_path / "prometheus", [f"127.0.0.1:{port}"]) as prom,
    ):
        # {short host}-{agent pid}: the agent runs in the launcher process.
        node = f"{socket.getfqdn().split('.')[0]}-{proc.pid}"

        def progressed(min_ckpt_step: float) -> str | None:
            assert proc.poll() is None, f"the launcher exited with {proc.poll()}:\n{proc.tail()}"
            text = scrape(url)
            ranks = {
                ls["rank"]
                for n, ls, v in samples(text)
                if n == "elastic_trainer_samples_total" and v > 0
            }
            ckpt = values(text, "elastic_trainer_last_checkpoint_step")
            return text if ranks == {"0", "1"} and ckpt and ckpt[0] >= min_ckpt_step else None

        before_text = wait_for(lambda: progressed(50), timeout=120, what="both ranks training and a checkpoint",
                               retry_on=(OSError,), interval=0.2)  # fmt: skip
        wait_for(
            prom.scrapes_ok,
            timeout=30,
            what="Prometheus scraping the node",
            retry_on=(OSError,),
            interval=0.2,
        )

        # promtool check metrics: a live scrape of a running job passes every lint, silently.
        lint = subprocess.run([promtool, "check", "metrics"], input=before_text, capture_output=True,
                              text=True, timeout=30)  # fmt: skip
        assert lint.returncode == 0 and lint.stdout.strip() == "" and lint.stderr.strip() == "", (
            lint.stdout + lint.stderr
        )

        poller = Poller(url)
        thread = threading.Thread(target=poller.run, daemon=True)
        thread.start()
        try:
            # A worker dies: the agent restarts the group; the launcher's endpoint stays up.
            victim = proc.worker_pids()[-1]
            samples_before = total(scrape(url), "elastic_trainer_samples_total")
            os.kill(victim, signal.SIGKILL)

            def restarted() -> str | None:
                text = scrape(url)
                losses = {ls["rank"] for n, ls, _ in samples(text) if n == "elastic_trainer_loss"}
                ok = (
                    values(text, "elastic_trainer_restarts_total") == [1.0]
                    and total(text, "elastic_trainer_samples_total") > samples_before + 25 * 128
                    and {"0", "1"} <= losses  # the new workers' first loss (a flush later)
                )
                return text if ok else None

            after_text = wait_for(restarted, timeout=120, what="training to resume after the restart",
                                  retry_on=(OSError,), interval=0.2)  # fmt: skip
            # The dead worker's live gauges went with it: one loss per rank, no stale pid.
            assert sorted(
                ls["rank"] for n, ls, _ in samples(after_text) if n == "elastic_trainer_loss"
            ) == ["0", "1"]
            assert not list((tmp_path / "multiproc").glob(f"gauge_live*_{victim}.db"))
            assert total(after_text, "elastic_trainer_checkpoint_loaded_bytes_total") > 0
            assert total(after_text, "elastic_trainer_rendezvous_duration_seconds_count") >= 2
            # One restart count: nothing else counts restarts.
            restart_counts = {
                n for n, _, _ in samples(after_text) if "restarts" in n and "remaining" not in n
            }
            assert restart_counts == {"elastic_trainer_restarts_total"}

            # The node's name is the same in the metrics and in `status` (from the rendezvous).
            status = read_status(etcd_server.endpoint, unique_id, {}, None)
            assert {p["name"] for p in status["participants"]} == {node}
            assert {
                ls["node"] for n, ls, _ in samples(after_text) if n.startswith("elastic_trainer_")
            } == {node}
        finally:
            poller.stop()
            thread.join(timeout=10)
        assert proc.wait(180) == 0, proc.tail()

        # Across the restart the endpoint never failed and the node's counters never went back.
        assert poller.ok >= 10 and poller.failures == []
        assert poller.samples_seen == sorted(poller.samples_seen)
        assert poller.samples_seen[-1] > poller.samples_seen[0]
        ended = time.time()

        # Prometheus saw no counter reset in any series of the run.
        window = f"{int(ended - started) + 30}s"
        resets = prom.query(f"resets(elastic_trainer_samples_total[{window}])")
        assert resets and all(float(r["value"][1]) == 0 for r in resets), resets
        restarts = prom.query(f"max_over_time(elastic_trainer_restarts_total[{window}])")
        assert restarts and max(float(r["value"][1]) for r in restarts) >= 1

        # Every dashboard expression, as Grafana would send it, returns finite data for the run.
        dashboard = load_dashboard()
        empty = []
        for where, expr in dashboard_expressions(dashboard):
            expr = expr.replace('run_id=~".*"', f'run_id=~"{unique_id}"')
            points = finite_points(
                prom.query_range(expr, started, ended, step=1.0)
            )  # raises if invalid
            if points == 0 and where not in ONLY_WITH_A_HEAL:
                empty.append(where)
        assert empty == [], f"dashboard queries without data: {empty}"
        assert {where for where, _ in dashboard_expressions(dashboard)} >= ONLY_WITH_A_HEAL
        for name, selector, label in variable_queries(dashboard):
            found = prom.label_values(label, selector)
            assert found, f"variable {name} has no values"
        assert unique_id in prom.label_values("run_id", "elastic_trainer_samples_total")
        assert prom.label_values("node", "elastic_trainer_samples_total") == [node]
