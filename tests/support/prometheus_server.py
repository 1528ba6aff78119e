"""A real Prometheus server for tests: own config, temp TSDB, free port, always stopped.

Uses the ``prometheus`` and ``promtool`` binaries of the Debian package ``prometheus``
(``apt-get install -y --no-install-recommends prometheus``), or ``$PROMETHEUS_BIN`` /
``$PROMTOOL_BIN``. The packaged system service is never used: the binary is started here with
``--storage.tsdb.path`` in a temp dir and ``--web.listen-address=127.0.0.1:<free port>``.

In CI (``CI=true``) a missing binary fails the test; elsewhere it skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from elastic_trainer.ops.processes import wait_for
from rendezvous.etcd_server import free_port
from tests.support.ci import IN_CI


def require_binary(name: str, env_var: str) -> str:
    """Path of ``name`` (``$env_var`` wins); fail in CI, skip elsewhere, when it is missing."""
    path = os.environ.get(env_var) or shutil.which(name) or f"/usr/bin/{name}"
    if os.access(path, os.X_OK):
        return path
    message = (
        f"{name} not found (install the Debian package: apt-get install -y "
        f"--no-install-recommends prometheus, or set {env_var})"
    )
    if IN_CI:
        pytest.fail(f"CI must have a real {name}: {message}")
    pytest.skip(message)


class PrometheusError(RuntimeError):
    """Prometheus answered with an error status."""


class PrometheusServer:
    """One Prometheus process scraping ``targets`` every ``scrape_interval``."""

    def __init__(self, *, work_dir: Path, targets: list[str], scrape_interval: str = "1s") -> None:
        self.binary = require_binary("prometheus", "PROMETHEUS_BIN")
        self.work_dir = work_dir
        self.targets = targets
        self.scrape_interval = scrape_interval
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = work_dir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "prometheus.yml"
        # JSON is YAML: no YAML library needed.
        config.write_text(
            json.dumps(
                {
                    "global": {
                        "scrape_interval": self.scrape_interval,
                        "evaluation_interval": self.scrape_interval,
                    },
                    "scrape_configs": [
                        {
                            "job_name": "elastic-trainer",
                            "scrape_timeout": self.scrape_interval,
                            "static_configs": [{"targets": self.targets}],
                        }
                    ],
                }
            )
        )
        self.port = free_port()
        with open(self._log, "wb") as log_file:
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.work_dir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1d",
                    "--log.level=warn",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self.work_dir,
            )
        try:
            wait_for(
                self._ready,
                timeout=timeout_s,
                what="Prometheus to be ready",
                retry_on=(OSError,),
                describe=self.log_tail,
                interval=0.2,
            )
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise PrometheusError(f"prometheus exited {self._proc.returncode}: {self.log_tail()}")
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
            return response.status == 200

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self._log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    # -- HTTP API ---------------------------------------------------------------------------------
    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; return ``data`` or raise :class:`PrometheusError`."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
            raise PrometheusError(f"{path} {params}: {body.get('error', exc)}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query at the current time; the result vector."""
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[Any]:
        return self.api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=str(step)
        )["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": match})

    def scrapes_ok(self) -> bool:
        """Every target was scraped successfully at least once and its last scrape was healthy."""
        targets = self.api("targets")["activeTargets"]
        return bool(targets) and all(t["health"] == "up" for t in targets)


@contextmanager
def prometheus_server(
    work_dir: Path, targets: list[str], scrape_interval: str = "1s"
) -> Iterator[PrometheusServer]:
    """A started :class:`PrometheusServer`, stopped on exit even when the test fails."""
    server = PrometheusServer(work_dir=work_dir, targets=targets, scrape_interval=scrape_interval)
    server.start()
    try:
        yield server
    finally:
        server.stop()
