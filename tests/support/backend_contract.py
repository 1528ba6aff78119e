"""The ``RendezvousBackend`` contract, as a mixin run against every implementation.

A subclass provides the ``make_backend`` fixture (``run_id -> backend``) and ``corrupt_state``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousStateError

MakeBackend = Callable[[str], Any]


class BackendContract:
    def corrupt_state(self, backend: Any, raw: bytes) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def test_absent_state_is_none(self, make_backend: MakeBackend, unique_id: str) -> None:
        assert make_backend(unique_id).get_state() is None

    def test_set_then_get(self, make_backend: MakeBackend, unique_id: str) -> None:
        backend = make_backend(unique_id)
        state, token, has_set = backend.set_state(b"first")
        assert (state, has_set) == (b"first", True)
        assert backend.get_state() == (b"first", token)

    def test_current_token_wins(self, make_backend: MakeBackend, unique_id: str) -> None:
        backend = make_backend(unique_id)
        _, token, _ = backend.set_state(b"one")
        state, new_token, has_set = backend.set_state(b"two", token)
        assert (state, has_set) == (b"two", True)
        assert new_token != token
        assert backend.get_state() == (b"two", new_token)

    @pytest.mark.parametrize("kind", ["stale", "none", "garbage", "negative"])
    def test_wrong_token_returns_current_state_unset(
        self, make_backend: MakeBackend, unique_id: str, kind: str
    ) -> None:
        backend = make_backend(unique_id)
        _, stale, _ = backend.set_state(b"one")
        _, current, _ = backend.set_state(b"two", stale)
        token = {"stale": stale, "none": None, "garbage": "not-a-token", "negative": -1}[kind]
        assert backend.set_state(b"three", token) == (b"two", current, False)
        assert backend.get_state() == (b"two", current)

    def test_corrupt_state_raises(self, make_backend: MakeBackend, unique_id: str) -> None:
        backend = make_backend(unique_id)
        backend.set_state(b"good")
        self.corrupt_state(backend, b"ETv3" + b"\x00" * 32 + b"tampered")
        with pytest.raises(RendezvousStateError, match="corrupt"):
            backend.get_state()
        self.corrupt_state(backend, b"x")
        with pytest.raises(RendezvousStateError):
            backend.get_state()

    def test_run_ids_are_isolated(self, make_backend: MakeBackend, unique_id: str) -> None:
        first, second = make_backend(unique_id + "-a"), make_backend(unique_id + "-b")
        first.set_state(b"a-state")
        assert second.get_state() is None
        second.set_state(b"b-state")
        assert first.get_state()[0] == b"a-state"

    def test_racing_writers_exactly_one_wins(
        self, make_backend: MakeBackend, unique_id: str
    ) -> None:
        backend = make_backend(unique_id)
        _, token, _ = backend.set_state(b"base")
        writers = 8
        barrier = threading.Barrier(writers)
        results: list[tuple[bytes, Any, bool]] = []
        lock = threading.Lock()

        def write(i: int) -> None:
            own = make_backend(unique_id)  # a separate client per "node"
            barrier.wait()
            result = own.set_state(f"writer-{i}".encode(), token)
            with lock:
                results.append(result)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        winners = [r for r in results if r[2]]
        assert len(results) == writers
        assert len(winners) == 1
        # Every loser saw the winner's state and token.
        assert all(r[:2] == winners[0][:2] for r in results)
