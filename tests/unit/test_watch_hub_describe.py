"""``WatchHub.describe``: the one-line state a stalled benchmark dumps (``benchmarks/scale_agents.py``
on SIGUSR1), read under the hub's lock instead of from its private fields."""

from __future__ import annotations

import time
from types import SimpleNamespace

from rendezvous import watch_hub
from rendezvous.watch_hub import WatchHub


class _Call:
    def __init__(self, active: bool) -> None:
        self.active = active

    def is_active(self) -> bool:
        return self.active


def test_a_fresh_hub_says_it_has_no_stream_and_never_failed() -> None:
    hub = WatchHub(SimpleNamespace(etcd3=None, endpoint="127.0.0.1:2379"))  # type: ignore[arg-type]
    assert hub.describe() == (
        "endpoint 127.0.0.1:2379, 0 active, 0 awaiting creation, 0 created, 0 events "
        "delivered, stream none, last failure never"
    )


def test_a_hub_names_its_watches_its_stream_and_its_last_failure() -> None:
    hub = WatchHub(SimpleNamespace(etcd3=None, endpoint="10.0.0.2:2379"))  # type: ignore[arg-type]
    hub._active.update({object(), object()})  # type: ignore[arg-type]
    hub._pending.append(object())  # type: ignore[arg-type]
    hub._by_id[7] = object()  # type: ignore[assignment]
    hub.events = 12
    hub.last_failure = time.monotonic() - 3.0
    hub._call = _Call(active=False)
    line = hub.describe()
    assert line.startswith(
        "endpoint 10.0.0.2:2379, 2 active, 1 awaiting creation, 1 created, 12 events delivered, "
        "stream ended, last failure 3."
    )
    assert line.endswith(" s ago")
    hub._call = _Call(active=True)
    assert "stream active" in hub.describe()


class _Connection:  # weakly referenced by the shared-hub table, which a SimpleNamespace cannot be
    etcd3 = None
    endpoint = "127.0.0.9:2379"

    def add_close_hook(self, hook: object) -> None:
        pass


def test_describe_all_covers_every_shared_hub() -> None:
    connection = _Connection()
    hub = WatchHub.of(connection)  # type: ignore[arg-type]
    try:
        assert hub.describe() in watch_hub.describe_all()
    finally:
        with watch_hub._SHARED_LOCK:
            watch_hub._SHARED.pop(connection, None)  # type: ignore[call-overload]
