"""A process that used etcd streams exits cleanly: no stream is still read when it stops.

A gRPC stream still being read while the interpreter exits can hang the exit for good (see
``rendezvous.etcd_client.join_stream_thread``); a torchrun agent once hung so after its workers
had finished. Closing a connection therefore waits for its stream threads, and a connection left
open is closed at exit, before the interpreter stops its daemon threads.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints
from rendezvous.etcd_server import EtcdServer
from rendezvous.lease_keeper import LeaseKeeper
from rendezvous.watch_hub import WatchHub

pytestmark = pytest.mark.integration

STREAM_THREADS = ("etcd-v3-watch", "etcd-v3-keepalive", "etcd3_watch_")

OPEN_EVERY_STREAM = """
conn = EtcdConnection(EtcdClientConfig(endpoints=parse_endpoints(ENDPOINT)))
revision = conn.call(lambda c: c.get_response("/exit-test").header.revision, what="a read")
WatchHub.of(conn).watch(
    "/exit-test/a", start_revision=revision, on_events=lambda e: None, on_lost=lambda r: None
)
lease = conn.call(lambda c: c.lease(5), what="a lease grant")
LeaseKeeper.of(conn).keep(lease.id, 5, lambda lease_id: None)
conn.client().add_watch_callback("/exit-test/b", lambda response: None)
"""


def stream_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(STREAM_THREADS)]


def test_close_returns_once_every_stream_thread_has_ended(etcd_server: EtcdServer) -> None:
    before = set(stream_threads())
    scope = {
        "ENDPOINT": etcd_server.endpoint,
        "EtcdConnection": EtcdConnection,
        "EtcdClientConfig": EtcdClientConfig,
        "parse_endpoints": parse_endpoints,
        "WatchHub": WatchHub,
        "LeaseKeeper": LeaseKeeper,
    }
    exec(OPEN_EVERY_STREAM, scope)
    opened = set(stream_threads()) - before
    assert len(opened) == 3, opened  # the hub's watch, the keep-alive, etcd3's own watch

    scope["conn"].close()

    assert not set(stream_threads()) & opened


def test_a_connection_left_open_is_closed_at_exit(etcd_server: EtcdServer) -> None:
    # The child's own exit hook is registered first, so it runs last (atexit is LIFO): it sees
    # what is left after the rendezvous package's hook ran.
    child = (
        textwrap.dedent(
            f"""
        import atexit, threading
        def report():
            names = [t.name for t in threading.enumerate() if t.name.startswith({STREAM_THREADS!r})]
            print("left at exit:", names, flush=True)
            import grpc._channel
            print("call finalizer:", grpc._channel._Rendezvous.__del__.__name__, flush=True)
        atexit.register(report)
        from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints
        from rendezvous.lease_keeper import LeaseKeeper
        from rendezvous.watch_hub import WatchHub
        ENDPOINT = {etcd_server.endpoint!r}
        """
        )
        + OPEN_EVERY_STREAM
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "left at exit: []" in done.stdout, done.stdout + done.stderr
    # No gRPC call's __del__ may wait for a lock once daemon threads can be stopped mid-way.
    assert "call finalizer: _no_finalizer" in done.stdout, done.stdout
    assert time.monotonic() - started < 30
