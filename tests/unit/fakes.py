"""In-memory stand-ins for unit tests only."""

from __future__ import annotations

import threading
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from rendezvous.etcd_backend import frame_state, unframe_state


class InMemoryBackend(RendezvousBackend):
    """A reference implementation of the backend contract over a shared dict."""

    def __init__(self, shared: dict[str, tuple[bytes, int]], lock: threading.Lock, run_id: str):
        self._shared, self._lock, self._key = shared, lock, run_id

    @property
    def name(self) -> str:
        return "in-memory"

    def get_state(self) -> tuple[bytes, Any] | None:
        with self._lock:
            entry = self._shared.get(self._key)
        return None if entry is None else (unframe_state(entry[0], key=self._key), entry[1])

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        with self._lock:
            entry = self._shared.get(self._key)
            current_rev = entry[1] if entry else 0
            valid = token is None and entry is None
            if token is not None:
                try:
                    valid = int(token) == current_rev and current_rev > 0
                except (TypeError, ValueError):
                    valid = False
            if valid:
                revision = self._shared.get("__rev__", (b"", 0))[1] + 1
                self._shared["__rev__"] = (b"", revision)
                self._shared[self._key] = (frame_state(state), revision)
                return state, revision, True
        current = self.get_state()
        return None if current is None else (*current, False)
