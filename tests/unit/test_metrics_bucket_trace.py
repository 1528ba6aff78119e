"""Bucket timings from the flight recorder: which collectives are DDP's buckets, which step each
belongs to, and the observer's metrics from them (real gloo DDP; durations added, as NCCL would)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_trainer.metrics import bucket_trace as metrics_bucket_trace
from elastic_trainer.metrics.bucket_trace import TracedBucketTimer, ddp_bucket_sizes
from elastic_trainer.metrics.collective_trace import CollectiveTrace, TracedCollective

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


class FakeTrace:
    """What the timer reads of a CollectiveTrace."""

    def __init__(self) -> None:
        self.queued: list[TracedCollective] = []
        self.lost = 0
        self.newest_record = -1
        self.reads = 0

    def read(self) -> list[TracedCollective]:
        self.reads += 1
        queued, self.queued = self.queued, []
        return queued


def launched(created_ns: int, nbytes: int) -> TracedCollective:
    return TracedCollective(record_id=created_ns, created_ns=created_ns, nbytes=nbytes, duration_s=0.002,
                            thread_id=None)  # fmt: skip


def model() -> DDP:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 8))
    return DDP(net, bucket_cap_mb=0.05)


def test_buckets_belong_to_the_synchronising_forward_before_them(
    gloo_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ddp, now, trace = model(), [0], FakeTrace()
    timer = TracedBucketTimer(ddp, trace=trace, ring_entries=2, clock_ns=lambda: now[0])  # type: ignore[arg-type]
    x = torch.randn(4, 64)
    for step in range(2):
        now[0] = 100 * (step + 1)  # forwards of steps 0 and 1 start at 100 and 200
        ddp(x).sum().backward()
    (first_guess,), rebuilt = ddp_bucket_sizes(ddp)
    assert not rebuilt  # DDP rebuilt its buckets in the second forward, but logs them in the third
    param_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters())
    small, large = 8193 * 8 * 4, 64 * 8192 * 4 + 8192 * 4  # the two rebuilt buckets
    assert first_guess == param_bytes == small + large
    trace.queued = [launched(50, first_guess), launched(120, first_guess), launched(150, 8),
                    launched(250, small), launched(260, large)]  # fmt: skip
    # 50 ns came before any forward; step 1's buckets and the 8 bytes wait for the rebuilt sizes.
    assert [(t.step_seq, t.nbytes) for t in timer.drain()] == [(0, first_guess)]
    assert timer.dropped == 1

    now[0] = 300
    ddp(x).sum().backward()
    now[0] = 1000
    with ddp.no_sync():
        ddp(x)  # a gradient-accumulation forward: its backward reduces nothing
    with torch.no_grad():
        ddp(x)  # an evaluation forward
    assert timer.step_seq == 3
    sizes, rebuilt = ddp_bucket_sizes(ddp)
    assert rebuilt and sizes == {first_guess, small, large}
    trace.queued = [launched(310, 8), launched(350, small), launched(1001, large)]
    got = timer.drain()
    # 8 bytes is no bucket (the runtime's control allreduce): left out once the sizes are known.
    assert [(t.step_seq, t.nbytes) for t in got] == [(1, small), (1, large), (2, small), (2, large)]
    assert [t.duration_s for t in got] == [0.002] * 4
    assert timer.drain() == [] and timer.dropped == 1

    monkeypatch.setattr(metrics_bucket_trace, "MAX_REMEMBERED_STEPS", 2)
    trace.queued = [launched(360, small)]
    assert [t.step_seq for t in timer.drain()] == [
        2
    ]  # a drain forgets all but the newest 2 forwards
    trace.queued = [launched(150, small), launched(360, small)]
    assert [t.step_seq for t in timer.drain()] == [2]
    assert timer.dropped == 2

    timer.remove()
    ddp(x).sum().backward()
    assert timer.step_seq == 3  # no longer counting


def test_without_a_rebuild_unknown_sizes_are_left_out_after_a_few_steps(
    gloo_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ddp, now, trace = model(), [0], FakeTrace()
    timer = TracedBucketTimer(ddp, trace=trace, ring_entries=2, clock_ns=lambda: now[0])  # type: ignore[arg-type]
    # A DDP that never logs rebuilt buckets (one bucket of 123 bytes).
    monkeypatch.setattr(metrics_bucket_trace, "ddp_bucket_sizes", lambda _ddp: ({123}, False))
    now[0] = 10
    ddp(torch.randn(4, 64))
    trace.queued = [launched(11, 8), launched(12, 123)]
    assert [t.nbytes for t in timer.drain()] == [123]
    assert len(timer._held) == 1
    for step in range(metrics_bucket_trace.HOLD_STEPS):
        now[0] = 20 + step
        ddp(torch.randn(4, 64))
    assert timer.drain() == [] and timer._held == []  # held HOLD_STEPS steps, then left out


def test_reads_once_about_half_the_ring_is_new(gloo_world: None) -> None:
    """Reading costs per entry in the ring, new or not: the timer learns the collectives per step and
    reads when ~half the ring is new, at least every MAX_READ_INTERVAL_S, and at every flush again
    after the ring wrapped between two reads."""
    ddp, trace, now = model(), FakeTrace(), [0.0]
    timer = TracedBucketTimer(ddp, trace=trace, ring_entries=100, clock=lambda: now[0])  # type: ignore[arg-type]
    x = torch.randn(4, 64)

    def steps(n: int) -> None:
        for _ in range(n):
            ddp(x)
            trace.newest_record += 10  # 10 collectives (all groups) per step

    steps(1)
    timer.drain()
    steps(1)
    timer.drain()  # the rate is unknown until two reads: both read
    assert trace.reads == 2
    for _ in range(4):
        steps(1)
        timer.drain()
    assert trace.reads == 2  # 40 new entries: under half the ring
    steps(1)
    timer.drain()
    assert trace.reads == 3  # 50 new
    timer.drain()
    now[0] += metrics_bucket_trace.MAX_READ_INTERVAL_S
    timer.drain()
    assert trace.reads == 4  # no new step, but the longest interval passed
    steps(5)
    trace.lost += 5  # this read finds the ring wrapped since the last: the rate is unreliable
    timer.drain()
    timer.drain()  # read again: every flush until a read after a step has measured the rate
    steps(1)
    timer.drain()
    assert trace.reads == 7
    steps(1)
    timer.drain()
    assert trace.reads == 7  # learnt again: 10 new entries are not worth a read


def test_an_unreadable_recorder_stops_the_timing_not_the_training(
    gloo_world: None, caplog: pytest.LogCaptureFixture
) -> None:
    ddp = model()
    trace = CollectiveTrace("0", dump=lambda: b"not a pickle")
    timer = TracedBucketTimer(ddp, trace=trace, ring_entries=2)
    ddp(torch.randn(4, 64)).sum().backward()
    with caplog.at_level("WARNING"):
        assert timer.drain() == [] and timer.drain() == []
    assert trace.reads == 1  # not read again
    assert "allreduce timing from the flight recorder stops" in caplog.text


OBSERVED_RUN = """
import json, os, pickle
from elastic_trainer.metrics.collective_trace import CollectiveTrace, _default_dump, trace_environment
trace_environment(os.environ, entries=1024)
import torch, torch.distributed as dist
from prometheus_client import CollectorRegistry
from elastic_trainer.metrics.worker import PrometheusObserver, WorkerLabels
from elastic_trainer.metrics.bucket_trace import TracedBucketTimer
from elastic_trainer.runtime.process_exit import exit_process
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

def with_durations():  # what NCCL's watchdog adds (gloo never times its entries)
    dump = pickle.loads(_default_dump())
    for e in dump["entries"]:
        e["duration_ms"] = 2.0
    return pickle.dumps(dump)

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 8))
ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.05)
registry = CollectorRegistry()
observer = PrometheusObserver(labels=WorkerLabels(run_id="j", node="n", rank=0, local_rank=0),
                              registry=registry, flush_interval_s=0.0, trace_allreduce=True)
# A 2-entry ring as far as pacing goes: read at every flush (the real ring holds 1024).
observer.attach_timer(TracedBucketTimer(ddp, trace=CollectiveTrace("0", dump=with_durations), ring_entries=2))
observer.on_start(world_size=1, restart_count=0)
x = torch.randn(16, 64)
for step in range(1, 6):
    dist.all_reduce(torch.zeros(2))  # the runtime's control allreduce, on DDP's group
    ddp(x).square().mean().backward()
    observer.on_step(step=step, duration_s=0.1, data_wait_s=0.0, samples=16, tokens=0, loss=None)
observer.flush()
labels = {"run_id": "j", "node": "n", "rank": "0", "local_rank": "0"}
value = lambda name: registry.get_sample_value("elastic_trainer_" + name, labels)
print(json.dumps({
    "param_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
    "bytes": value("allreduce_bytes_total"), "buckets": value("allreduce_duration_seconds_count"),
    "seconds": value("allreduce_duration_seconds_sum"), "sizes": value("allreduce_bucket_bytes_count"),
    "compute_count": value("step_compute_seconds_count"), "compute_sum": value("step_compute_seconds_sum"),
}), flush=True)
exit_process(0)
"""


def test_observer_in_trace_mode_times_every_bucket_and_pairs_steps_on_the_real_recorder() -> None:
    """The observer with a TracedBucketTimer over the real flight recorder of a gloo process: every
    bucket byte of 5 steps once, the control allreduce left out, and step_compute = step time minus
    the last bucket's duration for each step whose buckets are known to be complete (all but the
    last: a later step's bucket proves it). A fresh process: the recorder reads its size once."""
    proc = subprocess.run([sys.executable, "-c", OBSERVED_RUN], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bytes"] == 5 * r["param_bytes"], r  # + 5 x 8 bytes had the control counted
    assert r["buckets"] == r["sizes"] >= 5 + 4, r  # 1 bucket in the first pass, then 2 per step
    assert r["seconds"] == pytest.approx(r["buckets"] * 0.002), r
    assert r["compute_count"] == 4 and r["compute_sum"] == pytest.approx(4 * (0.1 - 0.002)), r
