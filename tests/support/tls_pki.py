"""A throwaway TLS PKI for tests: a CA, an etcd server certificate and a client certificate.

Made with the ``openssl`` CLI (``.ci/run`` installs it). Outside CI a missing ``openssl`` skips
the test that needs it; in CI (``CI=true``) it fails it, like every other real component.

    pki = make_pki(tmp_path / "pki")
    etcd --cert-file pki.server_cert --key-file pki.server_key --trusted-ca-file pki.ca_cert ...
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.ci import IN_CI


@dataclass(frozen=True, slots=True)
class Pki:
    """PEM files of one throwaway PKI; certificates are valid for one day."""

    ca_cert: Path
    """The CA certificate that signed both certificates below."""
    server_cert: Path
    """Server and client auth, SAN ``IP:127.0.0.1`` and ``DNS:localhost`` (an etcd member)."""
    server_key: Path
    client_cert: Path
    """Client auth only (a worker, for etcd's ``--client-cert-auth``)."""
    client_key: Path


def make_pki(directory: Path) -> Pki:
    """Create ``directory`` and a fresh CA, server certificate and client certificate in it.

    EC P-256 keys, unencrypted. Two calls give two unrelated CAs (for wrong-CA tests).
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        if IN_CI:
            pytest.fail("CI must have the openssl command")
        pytest.skip("the openssl command is not installed")
    directory.mkdir(parents=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True, timeout=30)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=ca", "-days", "1")
    for name, usage in (("server", "serverAuth,clientAuth"), ("client", "clientAuth")):
        (directory / f"{name}.ext").write_text(
            f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n"
        )
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
        )  # fmt: skip
    return Pki(
        ca_cert=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )
