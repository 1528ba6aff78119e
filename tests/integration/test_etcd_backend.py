"""The backend contract against a real etcd server."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rendezvous import create_backend
from tests.support.backend_contract import BackendContract

pytestmark = pytest.mark.integration


def params(endpoint: str, run_id: str, **conf: Any) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2, **conf)


class TestEtcdV3Backend(BackendContract):
    @pytest.fixture
    def make_backend(self, etcd_server):  # type: ignore[no-untyped-def]
        return lambda run_id: create_backend(params(etcd_server.endpoint, run_id))[0]

    def corrupt_state(self, backend: Any, raw: bytes) -> None:
        backend._connection.call(lambda c: c.put(backend.key, raw), what="corrupt")


def test_state_key_is_namespaced_and_leased(etcd_server, unique_id: str) -> None:
    backend, _ = create_backend(
        params(etcd_server.endpoint, unique_id, key_prefix="/custom/p", ttl=600)
    )
    backend.set_state(b"s")
    assert backend.key == f"/custom/p/{unique_id}/state"
    _, meta = backend._connection.call(lambda c: c.get(backend.key), what="read")
    assert meta.lease_id != 0
    ttl = backend._connection.call(lambda c: c.get_lease_info(meta.lease_id), what="lease").TTL
    assert 0 < ttl <= 600


def test_state_expires_with_its_ttl(etcd_server, unique_id: str) -> None:
    import time

    backend, _ = create_backend(params(etcd_server.endpoint, unique_id, ttl=2))
    backend.set_state(b"short-lived")
    deadline = time.monotonic() + 10
    while backend.get_state() is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert backend.get_state() is None
