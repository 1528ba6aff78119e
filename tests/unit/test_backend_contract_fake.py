"""The backend contract against the in-memory reference fake (keeps the contract honest)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.support.backend_contract import BackendContract
from tests.unit.fakes import InMemoryBackend


class TestInMemoryBackend(BackendContract):
    @pytest.fixture
    def make_backend(self):  # type: ignore[no-untyped-def]
        shared: dict[str, Any] = {}
        lock = threading.Lock()
        return lambda run_id: InMemoryBackend(shared, lock, run_id)

    def corrupt_state(self, backend: Any, raw: bytes) -> None:
        backend._shared[backend._key] = (raw, backend._shared[backend._key][1])
