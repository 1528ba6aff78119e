"""The etcd client against a real etcd served over mutual TLS (``--client-cert-auth``), as the
Helm chart's bundled etcd runs it: the right certificates connect, rendezvous and train; a missing
client certificate or a foreign CA fails with one clear line within ``retry_timeout``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints
from rendezvous.etcd_server import free_port
from rendezvous.handler import create_handler
from tests.conftest import _require_etcd_binary
from tests.support.tls_pki import Pki, make_pki

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class TlsEtcd:
    """A running single-member etcd whose client port speaks only mutual TLS."""

    endpoint: str
    """``127.0.0.1:PORT`` of the https client URL."""
    pki: Pki
    """The PKI whose CA signed the server and the accepted client certificate."""
    foreign: Pki
    """An unrelated PKI (wrong CA, untrusted client certificate)."""

    def conf(self, **overrides: str | None) -> dict[str, str]:
        """rdzv-conf keys for a mutual-TLS client; ``None`` drops a key."""
        conf: dict[str, str | None] = {
            "protocol": "https",
            "ca_cert": str(self.pki.ca_cert),
            "ssl_cert": str(self.pki.client_cert),
            "ssl_cert_key": str(self.pki.client_key),
            **overrides,
        }
        return {k: v for k, v in conf.items() if v is not None}


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsEtcd]:
    binary = _require_etcd_binary()
    base = tmp_path_factory.mktemp("etcd-tls")
    pki, foreign = make_pki(base / "pki"), make_pki(base / "foreign-pki")
    client, peer, metrics = free_port(), free_port(), free_port()
    client_url, peer_url = f"https://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    args = [
        binary,
        "--name", "etcd0",
        "--data-dir", str(base / "data"),
        "--listen-client-urls", client_url,
        "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url,
        "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"etcd0={peer_url}",
        # Health over plain http on a separate port: the client port refuses certificate-less probes.
        "--listen-metrics-urls", f"http://127.0.0.1:{metrics}",
        "--cert-file", str(pki.server_cert),
        "--key-file", str(pki.server_key),
        "--trusted-ca-file", str(pki.ca_cert),
        "--client-cert-auth",
        "--heartbeat-interval", "50",
        "--election-timeout", "500",
        "--log-level", "warn",
    ]  # fmt: skip
    log_path = base / "etcd.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_healthy(process, f"http://127.0.0.1:{metrics}/health", log_path)
        yield TlsEtcd(f"127.0.0.1:{client}", pki, foreign)
    finally:
        process.kill()
        process.wait(10)


def _wait_healthy(process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, f"etcd exited at start: {log_path.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if json.load(response).get("health") == "true":
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.05)
    pytest.fail(f"TLS etcd not healthy within 30 s: {log_path.read_text()[-2000:]}")


def params(tls_etcd: TlsEtcd, run_id: str, **conf: Any) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", tls_etcd.endpoint, run_id, 1, 1, **conf)


def test_connection_with_client_certificate_writes_and_reads(
    tls_etcd: TlsEtcd, unique_id: str
) -> None:
    pki = tls_etcd.pki
    connection = EtcdConnection(
        EtcdClientConfig(
            endpoints=parse_endpoints(tls_etcd.endpoint),
            protocol="https",
            ca_cert=str(pki.ca_cert),
            ssl_cert=str(pki.client_cert),
            ssl_cert_key=str(pki.client_key),
            retry_timeout=10,
        )
    )
    try:
        connection.check()
        assert connection.call(lambda c: c.uses_secure_channel, what="a probe") is True
        key = f"/elastic-trainer/tls-test/{unique_id}"
        connection.call(lambda c: c.put(key, b"over mutual TLS"), what="a put")
        value, _ = connection.call(lambda c: c.get(key), what="a get")
        assert value == b"over mutual TLS"
    finally:
        connection.close()


def test_lease_rendezvous_over_mutual_tls(tls_etcd: TlsEtcd, unique_id: str) -> None:
    handler = create_handler(params(tls_etcd, unique_id, retry_timeout=10, **tls_etcd.conf()))
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("probe", b"via the etcd store")  # the store rides the same TLS connection
        assert info.store.get("probe") == b"via the etcd store"
    finally:
        assert handler.shutdown() is True


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        # etcd's --client-cert-auth aborts the handshake with a "bad certificate" alert.
        ("no client certificate", "BAD_CERTIFICATE"),
        # We cannot verify the server's certificate against a CA that did not sign it.
        ("foreign CA", "CERTIFICATE_VERIFY_FAILED"),
        # etcd cannot verify a client certificate that another CA signed.
        ("untrusted client certificate", "BAD_CERTIFICATE"),
    ],
)
def test_refused_tls_fails_in_one_line_within_retry_timeout(
    tls_etcd: TlsEtcd, unique_id: str, case: str, reason: str
) -> None:
    foreign = tls_etcd.foreign
    overrides: dict[str, str | None] = {
        "no client certificate": {"ssl_cert": None, "ssl_cert_key": None},
        "foreign CA": {"ca_cert": str(foreign.ca_cert)},
        "untrusted client certificate": {
            "ssl_cert": str(foreign.client_cert),
            "ssl_cert_key": str(foreign.client_key),
        },
    }[case]
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as raised:
        create_handler(
            params(
                tls_etcd, unique_id, retry_timeout=2, read_timeout=1, **tls_etcd.conf(**overrides)
            )
        )
    elapsed = time.monotonic() - started
    message = str(raised.value)
    assert "\n" not in message, message
    assert message.startswith(f"etcd at {tls_etcd.endpoint} "), message
    # Bounded by retry_timeout, and the cause is named: gRPC's handshake error, not etcd3's bare
    # "etcd connection failed".
    assert "did not answer a status request within 2s (UNAVAILABLE: " in message, message
    assert re.search(f"(?i)handshake failed.*{reason}", message), message
    assert elapsed < 20, f"{case}: gave up after {elapsed:.1f}s, retry_timeout was 2s"


def test_cli_run_trains_over_mutual_tls(tls_etcd: TlsEtcd, tmp_path: Path) -> None:
    run_id = f"tls-cli-{uuid.uuid4().hex[:8]}"
    conf = ",".join(f"{k}={v}" for k, v in tls_etcd.conf(retry_timeout="10").items())
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_trainer.cli",
            "run",
            "--rdzv-endpoint",
            tls_etcd.endpoint,
            "--run-id",
            run_id,
            "--rdzv-conf",
            conf,
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            "--metrics-port",
            "0",
            "-m",
            "elastic_trainer.examples.synthetic_cnn",
            "--max-steps",
            "2",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=100,
        cwd=REPO,
        env={**os.environ},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final step 2 " in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]
