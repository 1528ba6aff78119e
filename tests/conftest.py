"""Shared fixtures: real etcd servers on free ports, always stopped.

In CI (``CI=true``) a test that needs a real component must never skip: a missing etcd binary
fails the session instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints
from rendezvous.etcd_server import EtcdServer, EtcdServerError, find_etcd_binary
from tests.support.ci import IN_CI


def _require_etcd_binary() -> str:
    try:
        return find_etcd_binary()
    except EtcdServerError as exc:
        if IN_CI:
            pytest.fail(f"CI must have a real etcd: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd shared by the session; tests isolate themselves with unique run ids/prefixes."""
    _require_etcd_binary()
    server = EtcdServer.single(tmp_path_factory.mktemp("etcd-session") / "data")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def connection(etcd_server: EtcdServer) -> Iterator[EtcdConnection]:
    """A client connection to the session's etcd, closed after the test."""
    conn = EtcdConnection(EtcdClientConfig(endpoints=parse_endpoints(etcd_server.endpoint)))
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def own_etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A private etcd that a test may stop, kill or restart."""
    _require_etcd_binary()
    server = EtcdServer.single(tmp_path / "etcd-data")
    server.start()
    try:
        yield server
    finally:
        server.stop(kill=True)


@pytest.fixture
def unique_id(request: pytest.FixtureRequest) -> str:
    """A run id unique to this test."""
    import uuid

    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")[:40]
    return f"{name}-{uuid.uuid4().hex[:8]}"
