"""ProgressPublisher over a fake etcd: when it writes, what it costs etcd, and that its record
counts restarts and heals as ``top`` does (issue 40, item 6)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_trainer.launch.progress_publisher import (
    DEFAULT_INTERVAL_S,
    POLL_S,
    ProgressKeys,
    ProgressPublisher,
    ProgressRecord,
)
from elastic_trainer.metrics.progress import Snapshot, progress_view, samples_of
from elastic_trainer.ops.scrape import Scrape
from elastic_trainer.ops.top import TopModel
from tests.unit.test_metrics_progress import node_text

pytestmark = pytest.mark.timeout(60)


@dataclass
class FakeEtcd:
    """The calls the publisher makes, in order, each with the time it was made."""

    clock: Any = time.monotonic
    calls: list[tuple[str, float]] = field(default_factory=list)
    puts: list[ProgressRecord] = field(default_factory=list)
    config: Any = field(default_factory=lambda: SimpleNamespace(retry_timeout=5.0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, fn: Any, *, what: str, retry_timeout: float | None = None, **_: Any) -> Any:
        return fn(self)

    def _note(self, kind: str) -> None:
        with self.lock:
            self.calls.append((kind, self.clock()))

    def lease(self, ttl: int) -> Any:
        self._note("grant")
        return SimpleNamespace(id=7)

    def refresh_lease(self, lease_id: int) -> Any:
        self._note("renew")
        return [SimpleNamespace(TTL=30)]

    def put(self, key: str, value: bytes, lease: int) -> None:
        self._note("put")
        record = ProgressRecord.decode(value)
        assert record is not None
        self.puts.append(record)

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.calls if k == kind)

    def close(self) -> None:
        pass


class Training:
    """A node's registry: rank 0's step moves whenever ``step`` does."""

    def __init__(self, **text: Any) -> None:
        self.step = 1
        self.text = text

    def collect(self) -> list[Any]:
        ranks = {0: {"step": self.step, "samples": 32 * self.step, "compute_sum": 0.02}}
        return list(text_string_to_metric_families(node_text(ranks=ranks, **self.text)))


def publisher(etcd: FakeEtcd, registry: Any, clock: Any, **kwargs: Any) -> ProgressPublisher:
    return ProgressPublisher(etcd, ProgressKeys("/p", "job"), registry, node="a-1", clock=clock,  # type: ignore[arg-type]
                             wall_clock=lambda: 1.7e9 + clock(), **kwargs)  # fmt: skip


def test_a_record_is_written_when_the_step_moved_else_once_an_interval() -> None:
    """Steps every 80 ms, the workers' values flushed once a second: a record each second while
    training (the published age stays under 2 s), and while idle one per interval; the lease
    is renewed once an interval however often records are written."""
    now = [0.0]
    etcd = FakeEtcd(clock=lambda: now[0])
    node = Training(node="a-1")
    pub = publisher(etcd, node, lambda: now[0])
    written: list[float] = []
    while now[0] < 30.0:  # 30 s of training: the step the registry shows moves at each flush
        node.step = 1 + int(now[0])  # a flush a second
        if pub.publish_once() is not None:
            written.append(now[0])
        now[0] += POLL_S
    gaps = [b - a for a, b in zip(written, written[1:], strict=False)]
    assert max(gaps) <= 1.0 and len(written) == 30, written
    assert etcd.count("put") == 30 and etcd.count("renew") <= 30 / DEFAULT_INTERVAL_S
    assert etcd.count("grant") == 1
    idle_from = now[0]
    while now[0] < idle_from + 30.0:  # the step stands still (a hang, a long checkpoint)
        pub.publish_once()
        now[0] += POLL_S
    assert etcd.count("put") == 30 + 3, "one record an interval while nothing moves"


def test_the_thread_publishes_every_second_while_training_at_the_default_interval() -> None:
    """The launcher's thread at the default 10 s interval: records about a second apart."""
    etcd = FakeEtcd()
    node = Training(node="a-1")
    started = time.monotonic()
    pub = publisher(etcd, node, time.monotonic)
    pub.start()
    try:
        while time.monotonic() - started < 3.0:
            node.step = 1 + int((time.monotonic() - started) / 0.5)
            time.sleep(0.05)
    finally:
        pub.close()
    puts = [t for kind, t in etcd.calls if kind == "put"]
    assert len(puts) >= 4, puts
    assert max(b - a for a, b in zip(puts, puts[1:], strict=False)) < 1.5, puts


def test_the_published_restarts_and_heals_are_the_ones_top_shows() -> None:
    """Node a-1 (global rank 0) saw no restart and one heal; b-2, which took part in a restart
    a-1 did not see, counts 1 and 2. The record rank 0's node publishes from its own registry
    and ``top`` over both endpoints say the same: the job's counts (``job_counts``)."""
    a = node_text(node="a-1", ranks={0: {"step": 50, "samples": 1, "compute_sum": 1.0}}, heals=1)
    b = node_text(node="b-2", ranks={1: {"step": 50, "samples": 1, "compute_sum": 1.0}},
                  restarts=1, heals=2)  # fmt: skip
    etcd = FakeEtcd()
    registry = SimpleNamespace(collect=lambda: list(text_string_to_metric_families(a)))
    record = publisher(etcd, registry, time.monotonic).publish_once()
    assert record is not None
    scrapes = [
        Scrape(url, samples=samples_of(text_string_to_metric_families(text)))
        for url, text in (("a:9400", a), ("b:9400", b))
    ]
    view = TopModel().update(scrapes, taken_at=1.0)
    assert (record.restarts, record.heals) == (view.restarts, view.heals) == (0, 1)


def test_without_rank_0_in_view_the_counts_are_the_highest_of_the_nodes() -> None:
    """``top`` on one node that does not host rank 0: what that node counted."""
    b = node_text(node="b-2", ranks={1: {"step": 5, "samples": 1, "compute_sum": 1.0}},
                  restarts=1, heals=2)  # fmt: skip
    view = progress_view(
        Snapshot.from_samples(samples_of(text_string_to_metric_families(b)), taken_at=0.0), None
    )
    assert (view.restarts, view.heals) == (1, 2)
