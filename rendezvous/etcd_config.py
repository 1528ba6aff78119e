"""Where an etcd v3 cluster is and how to authenticate to it: parsed and checked, without gRPC or torch.

    parse_endpoints("etcd-0:2379,etcd-1:2379")  # -> (Endpoint("etcd-0", 2379), Endpoint("etcd-1", 2379))

Split from :mod:`rendezvous.etcd_client` (which re-exports every name here) so that what only
validates settings -- ``elastic-trainer run --dry-run``, a user's typo in ``--rdzv-endpoint`` or
``--rdzv-conf`` -- is answered without importing torch (seconds on a cold start). Invariant: this
module imports nothing heavier than the standard library; every mistake is a ``ValueError``
whose message starts with the setting's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

DEFAULT_PORT = 2379


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One etcd member's client address."""

    host: str
    port: int = DEFAULT_PORT

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """Parse ``host[:port][,host[:port]...]`` (an optional ``http(s)://`` is ignored).

    Raises:
        ValueError: the text is empty or a host/port is malformed.
    """
    endpoints = []
    for raw in (text or "").split(","):
        item = raw.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme) :]
        item = item.rstrip("/")
        if not item:
            raise ValueError(f"rdzv endpoint: empty endpoint in {text!r}")
        host, sep, port_text = item.rpartition(":")
        if not sep:
            host, port_text = item, str(DEFAULT_PORT)
        host = host.strip("[]")
        if not host or any(c.isspace() or c in "/@?#" for c in host):
            raise ValueError(f"rdzv endpoint: malformed host in {raw.strip()!r}")
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(
                f"rdzv endpoint: port {port_text!r} in {raw.strip()!r} is not a number"
            ) from None
        if not 0 < port < 65536:
            raise ValueError(f"rdzv endpoint: port {port} in {raw.strip()!r} is out of range")
        endpoints.append(Endpoint(host, port))
    return tuple(endpoints)


@dataclass(kw_only=True, slots=True)
class EtcdClientConfig:
    """How to reach and authenticate to one etcd v3 cluster."""

    endpoints: tuple[Endpoint, ...]
    """Client addresses of the cluster's members; calls fail over between them."""
    read_timeout: float = 10.0
    """gRPC deadline, in seconds, of one request."""
    retry_timeout: float = 20.0
    """Total time, in seconds, within which transient faults are retried before giving up."""
    protocol: str = "http"
    """``http`` or ``https``."""
    ca_cert: str | None = None
    """Path of the CA certificate (PEM) that signed the server certificates."""
    ssl_cert: str | None = None
    """Path of the client certificate (PEM) for mutual TLS."""
    ssl_cert_key: str | None = None
    """Path of the client certificate's private key (PEM)."""
    user: str | None = None
    """etcd user name, when etcd auth is enabled."""
    password: str | None = field(default=None, repr=False)
    """That user's password (prefer ``password_file``)."""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("endpoints: at least one etcd endpoint is required")
        if not self.read_timeout > 0:
            raise ValueError(f"read_timeout: must be > 0 seconds, got {self.read_timeout}")
        if not self.retry_timeout > 0:
            raise ValueError(f"retry_timeout: must be > 0 seconds, got {self.retry_timeout}")
        check_security(self)


class Security(Protocol):
    """The TLS and auth settings (of an :class:`EtcdClientConfig`, or the rendezvous's)."""

    protocol: str
    ca_cert: str | None
    ssl_cert: str | None
    ssl_cert_key: str | None
    user: str | None
    password: str | None


def check_security(settings: Security) -> None:
    """Check ``settings``' TLS and auth settings together; read the PEM files' headers.

    Raises:
        ValueError: ``"<setting>: <problem>"`` for the first inconsistent or unreadable setting.
    """
    protocol, ssl_cert, ssl_cert_key = settings.protocol, settings.ssl_cert, settings.ssl_cert_key
    if protocol not in ("http", "https"):
        raise ValueError(f"protocol: must be 'http' or 'https', got {protocol!r}")
    if protocol == "http" and (settings.ca_cert or ssl_cert or ssl_cert_key):
        raise ValueError("protocol: TLS files were given, so the protocol must be 'https'")
    if bool(ssl_cert) != bool(ssl_cert_key):
        raise ValueError("ssl_cert: ssl_cert and ssl_cert_key must be given together")
    for name, path, marker in (
        ("ca_cert", settings.ca_cert, b"-----BEGIN CERTIFICATE-----"),
        ("ssl_cert", ssl_cert, b"-----BEGIN CERTIFICATE-----"),
        ("ssl_cert_key", ssl_cert_key, b"PRIVATE KEY-----"),
    ):
        if path:
            _check_pem_file(name, path, marker)
    if bool(settings.user) != (settings.password is not None):
        raise ValueError("user: user and password (or password_file) must be given together")


def _check_pem_file(name: str, path: str, marker: bytes) -> None:
    """Reject a missing, unreadable or non-PEM TLS file before gRPC turns it into a retried hang."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{name}: cannot read {path}: {exc.strerror or exc}") from exc
    if marker not in data:
        raise ValueError(
            f"{name}: {path} is not a PEM file (no {marker.decode().strip('-')!r} block)"
        )


def read_secret_file(path: str, *, key: str) -> str:
    """Read a password from a file (a mounted Kubernetes Secret), stripping one trailing newline.

    Raises:
        ValueError: the file cannot be read (naming ``key``).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{key}: cannot read {path}: {exc.strerror or exc}") from exc
    return text[:-1] if text.endswith("\n") else text
