"""Time every DDP gradient bucket's allreduce without adding a synchronisation to the step.

:func:`timed_allreduce_hook` is a DDP communication hook: torch's default allreduce (an average
over the group) with the bucket's future timestamped, by the monotonic clock on CPU and by CUDA
events on GPU. Events are only queried later (:meth:`AllreduceTimer.drain`), never synchronised.
The callback appends to a ``deque`` and the observer drains it: no lock on either side.

Register with ``ddp_model.register_comm_hook(AllreduceTimer(...), timed_allreduce_hook)``. Why
the hook is built this way (one callback per bucket is DDP's floor, kept thread states on gloo's
threads, NCCL averaging, event reuse): ``docs/design/metrics.md``. No ``from __future__ import
annotations`` here: DDP compares the hook's annotations with the real ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]``.
"""

import ctypes
import functools
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.runtime.comms import WorkerComms

# Bounds the memory of records nobody drains (e.g. a loop that never calls on_step).
DEFAULT_MAX_PENDING = 8192

_thread_state_kept = threading.local()
_kept_thread_states: list[int] = []  # idents of the threads whose state was kept (for tests)


@functools.cache
def _c_api() -> tuple[Callable[[], int | None], Callable[[], int | None], Callable[[], int]]:
    """CPython's GetThisThreadState, PyThreadState_Get and PyGILState_Ensure, as private
    prototypes: setting ``restype`` on ``ctypes.pythonapi``'s shared function objects would
    change them for every other user in the process."""
    api = ctypes.pythonapi
    return (
        ctypes.PYFUNCTYPE(ctypes.c_void_p)(("PyGILState_GetThisThreadState", api)),
        ctypes.PYFUNCTYPE(ctypes.c_void_p)(("PyThreadState_Get", api)),
        ctypes.PYFUNCTYPE(ctypes.c_int)(("PyGILState_Ensure", api)),
    )


def _keep_thread_state() -> None:
    """Keep this thread's Python thread state alive until the interpreter exits (once per thread).

    Called with the GIL held from a callback that pybind11 entered on a thread Python did not
    create. ``PyGILState_Ensure`` on the state pybind11 made for the call only raises its use
    count, so pybind11 no longer destroys it after the call and reuses it for the thread's next
    callback. On a thread Python made it raises a count nothing lowers (harmless). Not CPython:
    nothing to keep.
    """
    if getattr(_thread_state_kept, "done", False):
        return
    _thread_state_kept.done = True  # lives in this thread state, which now lives on
    if sys.implementation.name != "cpython":
        return
    this_thread_state, running_thread_state, gil_state_ensure = _c_api()
    # Only where Ensure finds the running state: otherwise it would make a second one and wait
    # for the GIL this thread holds.
    if this_thread_state() == running_thread_state():
        gil_state_ensure()
        _kept_thread_states.append(threading.get_ident())


CpuRecord = tuple[int, int, float, float]
"""One CPU-timed bucket as the hook stores it: (step_seq, nbytes, launched_s, done_s)."""


@dataclass(kw_only=True, slots=True)
class BucketTiming:
    """One bucket's allreduce, as measured on this rank."""

    step_seq: int
    """The step the bucket belongs to: :attr:`AllreduceTimer.step_seq` when it was launched."""
    nbytes: int
    """Size of the bucket's flat gradient buffer."""
    duration_s: float
    """Launch to completion of the bucket's allreduce."""
    launched_s: float | None
    """Monotonic launch time (CPU timing only; ``None`` with CUDA events)."""
    done_s: float | None
    """Monotonic completion time (CPU timing only; ``None`` with CUDA events)."""


@dataclass(slots=True)
class _PendingCuda:
    step_seq: int
    nbytes: int
    start: Any  # torch.cuda.Event
    end: Any | None  # set by the then-callback


class TimingRecords:
    """Where the hook's callbacks put their timings (on gloo's threads; on NCCL on the autograd
    thread): ``deque``s, whose ``append`` and ``popleft`` are atomic, so neither side takes a lock.

    Invariant: nothing here owns a process group. A callback can be the last owner of what it is
    bound to (gloo's thread drops the callback after running it, possibly after the training
    thread dropped everything else), and a gloo group destructed on one of its own threads joins
    that thread and aborts the process ("Resource deadlock avoided"). So the callbacks are bound
    to this object, never to the :class:`AllreduceTimer` that holds the group.
    """

    __slots__ = ("clock", "dropped", "_max_pending", "_done", "_cuda", "_free_events")

    def __init__(self, clock: Callable[[], float], max_pending: int) -> None:
        self.clock = clock
        self.dropped = 0
        """Records dropped because nobody drained them in time (the oldest go first)."""
        self._max_pending = max_pending
        self._done: deque[CpuRecord] = deque(maxlen=max_pending)
        self._cuda: deque[_PendingCuda] = deque(maxlen=max_pending)
        # Timing events whose elapsed time was read, reused instead of two new events per bucket.
        self._free_events: list[Any] = []

    def record_cpu(self, step_seq: int, nbytes: int, launched_s: float, done_s: float) -> None:
        """Store one completed CPU-timed bucket."""
        done = self._done
        if len(done) == self._max_pending:
            self.dropped += 1  # the deque drops the oldest itself
        done.append((step_seq, nbytes, launched_s, done_s))

    def cpu_done(self, step_seq: int, nbytes: int, launched_s: float, fut: Any) -> torch.Tensor:
        """(the bucket future's callback) Timestamp the bucket and unwrap its value."""
        done_s = self.clock()
        if not getattr(_thread_state_kept, "done", False):
            _keep_thread_state()
        value = fut.value()[0]  # raises if the collective failed: nothing is recorded then
        done = self._done  # record_cpu, inlined: this runs once per bucket on the critical path
        if len(done) == self._max_pending:
            self.dropped += 1
        done.append((step_seq, nbytes, launched_s, done_s))
        return value

    def add_cuda(self, pending: _PendingCuda) -> None:
        if len(self._cuda) == self._max_pending:
            self.dropped += 1
        self._cuda.append(pending)

    def event(self) -> Any:
        """A timing CUDA event: one whose timing was drained already, else a new one. The hook and
        its callbacks take events, :meth:`AllreduceTimer.drain` gives them back (``list.pop`` and
        ``extend`` are atomic under the GIL, so any thread may take one)."""
        try:
            return self._free_events.pop()
        except IndexError:
            return torch.cuda.Event(enable_timing=True)

    def cuda_done(self, pending: _PendingCuda, fut: Any) -> torch.Tensor:
        """(the bucket future's callback, on the collective's stream) Record the end event."""
        value = fut.value()[0]  # raises if the collective failed: nothing is recorded then
        end = self.event()
        end.record()  # on the callback's stream, which waits for the collective
        pending.end = end
        self.add_cuda(pending)
        return value


class AllreduceTimer:
    """State of :func:`timed_allreduce_hook`: the group, and per-bucket timings until drained.

    The hook's callbacks write to :attr:`records` (see :class:`TimingRecords` for why they are
    bound to it and not to this object).

    Args:
        process_group: the DDP model's process group (``None``: the default group).
        use_cuda: time with CUDA events (gradients on GPU) instead of the monotonic clock.
        clock: monotonic clock, injectable for tests.
        max_pending: records kept at most before the oldest are dropped (and counted).
        comms: the worker's runtime context: its abortable waits track every bucket's future and
            the step's control rides on a bucket (``None``: plain futures, nothing rides).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        use_cuda: bool = False,
        clock: Callable[[], float] = time.monotonic,
        max_pending: int = DEFAULT_MAX_PENDING,
        comms: WorkerComms | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.process_group = process_group
        self.use_cuda = use_cuda
        self.comms = comms
        self.clock = clock
        self.step_seq = 0
        """Synchronised backward passes whose last bucket was launched so far, which is also the
        step index (from 0) of the buckets launched now. The hook advances it on DDP's last
        bucket (``GradBucket.is_last``), so a bucket is attributed to the backward that launched
        it however late the training loop reports its steps."""
        self.records = TimingRecords(clock, max_pending)
        self._group: Any = None  # resolved on the first bucket (after init_process_group)
        self._world = 1
        self._divide = False
        self._options = dist.AllreduceOptions()

    @property
    def dropped(self) -> int:
        """Records dropped because nobody drained them in time."""
        return self.records.dropped

    def _resolve_group(self) -> Any:
        """The group, and how it averages: CUDA buckets on NCCL in the collective
        (``ReduceOp.AVG``), anything else by dividing the bucket first, as torch's hooks do
        against fp16 overflow; one rank divides by nothing. ``name()`` is the group's default
        backend, which reduces these buckets only with ``use_cuda`` (a ``cpu:gloo,cuda:nccl``
        group reports "nccl")."""
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("the allreduce timing hook ran before init_process_group")
        self._world = group.size()
        nccl = self.use_cuda and group.name() == "nccl"
        if nccl:
            self._options.reduceOp = dist.ReduceOp(dist.ReduceOp.AVG)
        self._divide = self._world > 1 and not nccl
        self._group = group
        return group

    def record_cpu(self, step_seq: int, nbytes: int, launched_s: float, done_s: float) -> None:
        """Store one completed CPU-timed bucket (what the hook's callback does)."""
        self.records.record_cpu(step_seq, nbytes, launched_s, done_s)

    def add_cuda(self, pending: _PendingCuda) -> None:
        """Store one CUDA-timed bucket whose end event is recorded."""
        self.records.add_cuda(pending)

    def next_step(self) -> None:
        """Mark the end of a backward pass: buckets launched from now on belong to the next step.

        The hook calls this after launching DDP's last bucket; tests call it to fake one."""
        self.step_seq += 1

    def drain_cpu(self) -> list[CpuRecord]:
        """Return and forget every CPU-timed record, oldest first (the observer's fast path)."""
        done = self.records._done
        return [done.popleft() for _ in range(len(done))]

    def drain(self) -> list[BucketTiming]:
        """Return and forget every finished timing, oldest first. Never blocks on the GPU."""
        timings = [
            BucketTiming(
                step_seq=seq,
                nbytes=nbytes,
                duration_s=max(0.0, done - launched),
                launched_s=launched,
                done_s=done,
            )  # fmt: skip
            for seq, nbytes, launched, done in self.drain_cpu()
        ]
        records = self.records
        cuda = records._cuda
        # Collectives on one stream finish in launch order: stop at the first one still running
        # instead of querying (or waiting for) the rest.
        while cuda:
            pending = cuda[0]
            if pending.end is None or not pending.end.query():
                break
            popped = cuda.popleft()
            if (
                popped is not pending
            ):  # a full deque dropped the one queried while the hook appended
                if popped.end is None or not popped.end.query():
                    records.dropped += 1  # never wait: drop this one too
                    continue
                pending = popped
            timings.append(
                BucketTiming(
                    step_seq=pending.step_seq,
                    nbytes=pending.nbytes,
                    duration_s=pending.start.elapsed_time(pending.end) / 1000.0,
                    launched_s=None,
                    done_s=None,
                )
            )
            records._free_events.extend((pending.start, pending.end))  # read: free to record again
        return timings


def timed_allreduce_hook(
    state: AllreduceTimer, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: torch's default allreduce (an average), with the bucket's future timestamped
    by its one Python callback (the one DDP requires), which also unwraps the result."""
    buffer = bucket.buffer()
    step_seq = state.step_seq
    if bucket.is_last():
        state.step_seq = step_seq + 1  # the next backward's buckets belong to the next step
    group = state._group if state._group is not None else state._resolve_group()
    if state._divide:  # the average (see AllreduceTimer._resolve_group)
        buffer.div_(state._world)
    records = state.records  # what the callback is bound to: never the group (see TimingRecords)
    if state.use_cuda:
        start = records.event()
        start.record()
        pending = _PendingCuda(step_seq, buffer.nbytes, start, None)
        fut = group.allreduce([buffer], state._options).get_future()
        return fut.then(partial(records.cuda_done, pending))  # type: ignore[no-any-return]

    launched = state.clock()
    then = partial(records.cpu_done, step_seq, buffer.nbytes, launched)
    comms = state.comms
    if comms is None:
        return group.allreduce([buffer], state._options).get_future().then(then)  # type: ignore[no-any-return]
    fut = comms.rider.allreduce(group, buffer, state._options)  # the step's control may ride on it
    # Healing in place, the training thread waits on a tracked future an abort can end (gloo
    # may never end a collective whose connections were cut; see runtime/abortable.py).
    return comms.waits.track(fut, then)


def exposed_wait_s(timings: list[BucketTiming]) -> float:
    """Time one step's last bucket waited for its allreduce to finish, from that step's buckets.

    After the last bucket is launched the backward pass has nothing left to overlap with, so
    this is the communication time the step could not hide. In synchronous data parallelism it
    also holds the time this rank waited for slower peers: the straggler waits least.
    """
    if not timings:
        return 0.0
    launches = [t.launched_s for t in timings if t.launched_s is not None]
    dones = [t.done_s for t in timings if t.done_s is not None]
    if len(launches) == len(dones) == len(timings):
        return max(0.0, max(dones) - max(launches))
    return timings[-1].duration_s
