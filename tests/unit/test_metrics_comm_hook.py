"""The allreduce timing hook on a real (single-process gloo) DDP model, and its bookkeeping."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from elastic_trainer.metrics.allreduce_hook import (
    AllreduceTimer,
    BucketTiming,
    _PendingCuda,
    exposed_wait_s,
)
from elastic_trainer.metrics.worker import PrometheusObserver, WorkerLabels

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 8))


def test_hook_times_every_bucket_and_keeps_gradients(gloo_world: None) -> None:
    registry = CollectorRegistry()
    labels = WorkerLabels(run_id="j", node="n", rank=0, local_rank=0)
    observer = PrometheusObserver(
        labels=labels, registry=registry, sample_allreduce=False
    )  # the hook mode
    plain = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.05)
    hooked = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.05)
    observer.wrap_ddp(hooked)
    observer.on_start(world_size=1, restart_count=0)
    x = torch.randn(16, 64)
    rank = {"run_id": "j", "node": "n", "rank": "0", "local_rank": "0"}
    for n in (1, 2):  # DDP uses a single bucket in its first iteration, then rebuilds them
        for ddp in (plain, hooked):
            ddp.zero_grad()
            ddp(x).square().mean().backward()
        for a, b in zip(plain.parameters(), hooked.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.equal(a.grad, b.grad)
        observer.on_step(step=n, duration_s=0.1, data_wait_s=0.0, samples=16, tokens=0, loss=None)
    observer.flush()
    timer = observer._timer
    assert timer is not None and timer.step_seq == 2  # one step per backward (GradBucket.is_last)
    buckets = registry.get_sample_value("elastic_trainer_allreduce_duration_seconds_count", rank)
    assert buckets is not None and buckets >= 3  # 1 + (1 MiB first bucket, then 0.05 MB caps)
    param_bytes = sum(p.numel() * p.element_size() for p in hooked.parameters())
    total = registry.get_sample_value("elastic_trainer_allreduce_bytes_total", rank)
    assert total == 2 * param_bytes
    assert registry.get_sample_value("elastic_trainer_step_compute_seconds_count", rank) == 2


def _gloo_pair() -> tuple[dist.ProcessGroupGloo, dist.ProcessGroupGloo]:
    """Two gloo ranks of one group, both in this process."""
    import threading
    from datetime import timedelta

    store = dist.HashStore()
    groups: list[object] = [None, None]

    def connect(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))

    connecting = [threading.Thread(target=connect, args=(rank,)) for rank in (0, 1)]
    for thread in connecting:
        thread.start()
    for thread in connecting:
        thread.join(timeout=30)
    rank0, rank1 = groups
    assert isinstance(rank0, dist.ProcessGroupGloo) and isinstance(rank1, dist.ProcessGroupGloo)
    return rank0, rank1


def test_the_average_is_a_division_on_gloo_and_in_the_collective_on_nccl(gloo_world: None) -> None:
    one = AllreduceTimer()
    one._resolve_group()
    assert (
        not one._divide and one._options.reduceOp == dist.ReduceOp.SUM
    )  # one rank: nothing to divide

    class Group:  # what the timer reads of a group (real ones: below, and NCCL in tests/gpu)
        def __init__(self, backend: str) -> None:
            self.backend = backend

        def size(self) -> int:
            return 2

        def name(self) -> str:
            return self.backend

    two = AllreduceTimer(Group("gloo"))  # type: ignore[arg-type]
    two._resolve_group()
    assert two._divide and two._world == 2 and two._options.reduceOp == dist.ReduceOp.SUM

    nccl = AllreduceTimer(Group("nccl"), use_cuda=True)  # type: ignore[arg-type]
    nccl._resolve_group()
    assert not nccl._divide and nccl._options.reduceOp == dist.ReduceOp.AVG
    # name() is the default backend: a cpu:gloo,cuda:nccl group says "nccl", but CPU buckets go to gloo
    cpu_buckets = AllreduceTimer(Group("nccl"))  # type: ignore[arg-type]
    cpu_buckets._resolve_group()
    assert cpu_buckets._divide and cpu_buckets._options.reduceOp == dist.ReduceOp.SUM


AVERAGING_RANK = """
import copy, sys, torch, torch.distributed as dist
from elastic_trainer.metrics.allreduce_hook import AllreduceTimer, timed_allreduce_hook
from elastic_trainer.runtime.process_exit import exit_process
rank, store, average = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
local = copy.deepcopy(model)
ddp = torch.nn.parallel.DistributedDataParallel(model)
timer = AllreduceTimer()
ddp.register_comm_hook(timer, timed_allreduce_hook)
if average == "collective":  # what NCCL gets; gloo in torch 2.13 accepts AVG too
    timer._resolve_group()
    timer._options.reduceOp, timer._divide = dist.ReduceOp(dist.ReduceOp.AVG), False
torch.manual_seed(1 + rank)
x = torch.randn(4, 8) * (1 + 10 * rank)
ddp(x).sum().backward()
local(x).sum().backward()
mean_matches, differs_from_local = True, False
for ours, mine in zip(model.parameters(), local.parameters()):
    expected = mine.grad.clone()
    dist.all_reduce(expected)
    mean_matches &= torch.allclose(ours.grad, expected / 2, rtol=1e-5, atol=1e-6)
    differs_from_local |= not torch.allclose(ours.grad, mine.grad)
print(mean_matches, differs_from_local, timer._divide, flush=True)
dist.barrier()
exit_process(0)  # not through gloo's C++ teardown, which can abort (see process_exit)
"""


@pytest.mark.parametrize("average", ["divide", "collective"])
def test_the_hook_averages_gradients_over_two_real_gloo_processes(
    average: str, tmp_path: Path
) -> None:
    """Real DDP at world size 2 (where dividing, averaging and summing differ): each rank's hooked
    gradients are the mean of both ranks' local gradients."""
    command = [sys.executable, "-c", AVERAGING_RANK]
    procs = [
        subprocess.Popen(
            [*command, str(rank), str(tmp_path / "store"), average],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-2000:]
        assert out.split() == ["True", "True", str(average == "divide")], out + err[-2000:]


def test_callback_threads_keep_one_python_thread_state() -> None:
    """gloo completes a collective on a thread Python did not create, and the bucket callback
    runs there: each such thread keeps one Python thread state for its life (a thread-local set
    in its first callback is still there in the 20th) instead of one made and destroyed per
    bucket. Two ranks in this process, so that rank 0's allreduce is still running (waiting for
    rank 1) when its callback is attached: the callback cannot run inline."""
    import threading

    from elastic_trainer.metrics import allreduce_hook as metrics_comm_hook

    rank0, rank1 = _gloo_pair()
    timer = AllreduceTimer()
    seen: list[int] = []

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        seen.append(threading.get_ident())
        return timer.records.cpu_done(0, 16, 0.0, fut)

    before = len(metrics_comm_hook._kept_thread_states)
    for _ in range(20):
        result = rank0.allreduce([torch.ones(4)]).get_future().then(done)
        rank1.allreduce([torch.ones(4)]).wait()
        assert torch.equal(result.wait(), torch.full((4,), 2.0))
    kept = metrics_comm_hook._kept_thread_states[before:]
    assert len(seen) == 20 and threading.main_thread().ident not in seen
    for ident in set(seen):
        # Kept once: had the state been destroyed after a callback, its thread-local flag would
        # be gone and the thread's next callback would keep a state again.
        assert kept.count(ident) == 1, (ident, kept)
    assert len(timer.drain_cpu()) == 20


LAST_OWNER_ON_GLOO_THREAD = """
import threading, time, torch, torch.distributed as dist
from datetime import timedelta
from elastic_trainer.metrics.allreduce_hook import AllreduceTimer, timed_allreduce_hook
from elastic_trainer.runtime.comms import WorkerComms
raw = []
comms = WorkerComms()
launch = comms.rider.allreduce
comms.rider.allreduce = lambda *args: raw.append(launch(*args)) or raw[-1]
store, groups = dist.HashStore(), [None, None]
def connect(rank):
    groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
connecting = [threading.Thread(target=connect, args=(rank,)) for rank in (0, 1)]
for thread in connecting: thread.start()
for thread in connecting: thread.join()
rank0, rank1 = groups
groups.clear()
class Bucket:
    def buffer(self): return torch.ones(4)
    def is_last(self): return True
timer = AllreduceTimer(rank0, comms=comms)
result = timed_allreduce_hook(timer, Bucket())
# gloo's thread drops the timer's callback only after this one, long after the waiter went on
raw.pop().add_done_callback(lambda done: time.sleep(0.5))
rank1.allreduce([torch.ones(4)]).wait()
value = result.wait()
del result, timer, rank0  # the callback is now the last owner of what it is bound to
time.sleep(1.0)
print(value.tolist(), flush=True)
"""


def test_a_bucket_callback_never_owns_the_group() -> None:
    """gloo's thread drops a bucket callback after running it, so the callback can be the last
    owner of what it is bound to. Had it owned the group, the group would be destructed on its own
    thread, which joins itself and aborts the process ("Resource deadlock avoided"): how CI's
    pytest process died once."""
    proc = subprocess.run([sys.executable, "-c", LAST_OWNER_ON_GLOO_THREAD], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[0] == "[1.5, 1.5, 1.5, 1.5]", proc.stdout  # (1/2 + 1), ran


def test_exposed_wait_is_last_done_minus_last_launch() -> None:
    def t(launched: float, done: float) -> BucketTiming:
        return BucketTiming(
            step_seq=0, nbytes=1, duration_s=done - launched, launched_s=launched, done_s=done
        )

    assert exposed_wait_s([]) == 0.0
    assert exposed_wait_s([t(1.0, 1.5), t(1.2, 1.3)]) == pytest.approx(0.3)
    cuda = [
        BucketTiming(step_seq=0, nbytes=1, duration_s=d, launched_s=None, done_s=None)
        for d in (0.5, 0.2)
    ]
    assert exposed_wait_s(cuda) == 0.2


def test_timer_bounds_undrained_records() -> None:
    timer = AllreduceTimer(max_pending=2)
    for i in range(3):
        timer.record_cpu(0, i, launched_s=0.0, done_s=1.0)
    assert timer.dropped == 1
    assert [t.nbytes for t in timer.drain()] == [1, 2]
    assert timer.drain() == []
    with pytest.raises(ValueError, match="max_pending"):
        AllreduceTimer(max_pending=0)


class FakeEvent:
    def __init__(self, done: bool, ms: float = 0.0) -> None:
        self.done = done
        self.ms = ms

    def query(self) -> bool:
        return self.done

    def record(self) -> None:
        self.done = False  # recorded again: pending until the (fake) GPU gets there

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.ms - self.ms


def test_cuda_drain_never_waits_for_unfinished_events() -> None:
    timer = AllreduceTimer(use_cuda=True)
    finished = _PendingCuda(0, 10, FakeEvent(True, 0.0), FakeEvent(True, 4.0))
    running = _PendingCuda(0, 20, FakeEvent(True, 5.0), FakeEvent(False, 9.0))
    later = _PendingCuda(1, 30, FakeEvent(True, 9.0), FakeEvent(True, 10.0))
    for pending in (finished, running, later):
        timer.add_cuda(pending)
    first = timer.drain()
    assert [(t.nbytes, t.duration_s) for t in first] == [(10, 0.004)]
    running.end.done = True
    assert [t.nbytes for t in timer.drain()] == [20, 30]


def test_cuda_events_are_reused_once_drained_and_not_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    created: list[FakeEvent] = []

    def new_event(enable_timing: bool = False) -> FakeEvent:
        assert enable_timing
        created.append(FakeEvent(False))
        return created[-1]

    monkeypatch.setattr(torch.cuda, "Event", new_event)
    timer = AllreduceTimer(use_cuda=True)

    def bucket(seq: int) -> _PendingCuda:  # what the hook does for one bucket, its collective done
        pending = _PendingCuda(seq, 8, timer.records.event(), None)
        failed: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        failed.set_exception(RuntimeError("collective failed"))
        timer.records.cuda_done(pending, failed)
        return pending

    with pytest.raises(RuntimeError, match="collective failed"):
        bucket(0)  # a failed collective records nothing and keeps its start event out of the pool
    assert len(created) == 1 and not timer.records._cuda and not timer.records._free_events

    class Done(torch.futures.Future):  # type: ignore[type-arg]
        def value(self) -> list[torch.Tensor]:
            return [torch.zeros(1)]

    first = _PendingCuda(1, 8, timer.records.event(), None)
    timer.records.cuda_done(first, Done())
    assert len(created) == 3 and timer.drain() == []  # still running on the GPU: kept
    assert timer.records.event() is not first.start and len(created) == 4  # nothing is free yet
    first.start.done = first.end.done = True  # type: ignore[union-attr]
    assert [t.step_seq for t in timer.drain()] == [1]
    reused = {id(timer.records.event()), id(timer.records.event())}
    assert reused == {id(first.start), id(first.end)} and len(created) == 4


def test_the_default_times_allreduces_from_ddp_s_sampled_statistics_without_a_hook(
    gloo_world: None,
) -> None:
    """Issue 30: the default puts nothing on DDP's per-bucket path; the allreduce metrics come from
    DDP's own C++ timing of sampled backwards (its first ten, then one in ten)."""
    from elastic_trainer.runtime import torch_compat

    registry = CollectorRegistry()
    labels = WorkerLabels(run_id="j", node="n", rank=0, local_rank=0)
    observer = PrometheusObserver(labels=labels, registry=registry, flush_interval_s=0.0)
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.05)
    observer.wrap_ddp(ddp)
    assert torch_compat.comm_hooks(ddp) == [], "no Python comm hook at the default"
    observer.on_start(world_size=1, restart_count=0)
    x = torch.randn(16, 64)
    rank = {"run_id": "j", "node": "n", "rank": "0", "local_rank": "0"}
    steps = 3
    for n in range(1, steps + 1):
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        observer.on_step(step=n, duration_s=0.1, data_wait_s=0.0, samples=16, tokens=0, loss=None)
    # DDP computes a backward's statistics at the next forward: the last one is not in yet.
    samples = registry.get_sample_value("elastic_trainer_allreduce_duration_seconds_count", rank)
    assert samples == steps - 1, (
        "one sample per flush here (each of DDP's first ten backwards is timed)"
    )
    param_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters())
    sizes = [int(s) for s in torch_compat.ddp_logging_data(ddp)["rebuilt_bucket_sizes"].split(",")]
    assert (
        len(sizes) >= 2 and sum(sizes) == param_bytes
    )  # per parameter: a first bucket, then 0.05 MB caps
    assert (
        registry.get_sample_value("elastic_trainer_allreduce_bucket_bytes_sum", rank)
        == (steps - 1) * param_bytes
    )
    # Every step's bytes count, at the newest sample's sizes (none before the first sample).
    assert (
        registry.get_sample_value("elastic_trainer_allreduce_bytes_total", rank)
        == (steps - 1) * param_bytes
    )
    assert registry.get_sample_value("elastic_trainer_step_compute_seconds_count", rank) == steps
    compute = registry.get_sample_value("elastic_trainer_step_compute_seconds_sum", rank)
    assert compute is not None and 0 < compute <= steps * 0.1
