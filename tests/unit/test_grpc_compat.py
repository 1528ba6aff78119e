"""gRPC's polling slice: our etcd streams are read off the main thread, so their waits poll every
second, not ten times a second (each poll woke a worker's thread and took the GIL)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from grpc import _common

from rendezvous import grpc_compat


@pytest.fixture
def slice_restored() -> Iterator[None]:
    before = _common.MAXIMUM_WAIT_TIMEOUT
    try:
        yield
    finally:
        _common.MAXIMUM_WAIT_TIMEOUT = before


def test_the_slice_becomes_a_second_and_is_never_shortened(slice_restored: None) -> None:
    _common.MAXIMUM_WAIT_TIMEOUT = 0.1
    grpc_compat.quiet_stream_waits()
    assert _common.MAXIMUM_WAIT_TIMEOUT == grpc_compat.STREAM_WAIT_SLICE_S == 1.0
    grpc_compat.quiet_stream_waits()  # idempotent
    assert _common.MAXIMUM_WAIT_TIMEOUT == 1.0
    _common.MAXIMUM_WAIT_TIMEOUT = 5.0
    grpc_compat.quiet_stream_waits()
    assert _common.MAXIMUM_WAIT_TIMEOUT == 5.0


def test_a_wait_still_ends_when_notified(slice_restored: None) -> None:
    """The slice only bounds how often an idle wait polls: a response (a notify) ends it at once."""
    grpc_compat.quiet_stream_waits()
    condition, done = threading.Condition(), [False]

    def respond() -> None:
        time.sleep(0.05)
        with condition:
            done[0] = True
            condition.notify_all()

    threading.Thread(target=respond).start()
    started = time.monotonic()
    with condition:
        _common.wait(condition.wait, lambda: done[0])
    assert time.monotonic() - started < 0.5
