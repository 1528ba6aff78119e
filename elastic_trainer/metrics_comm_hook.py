"""Time every DDP gradient bucket's allreduce without adding a synchronisation to the step.

:func:`timed_allreduce_hook` is a DDP communication hook that runs torch's default allreduce
(as ``default_hooks.allreduce_hook``: divide by world size, ``all_reduce``) and timestamps the
bucket's future:

- on CPU (gloo) with ``time.monotonic()`` when the hook launches the bucket and in a
  ``future.then`` callback when its allreduce completes;
- on GPU with a CUDA event recorded on the current stream at launch and another recorded in the
  ``then`` callback, which runs on a stream that waits for the collective. The events are only
  *queried* later (:meth:`AllreduceTimer.drain`), never synchronised, so the host never blocks
  on the GPU for the sake of metrics.

The hook only appends to a list; the observer turns the records into Prometheus samples on the
training thread once per step. This module deliberately does not use
``from __future__ import annotations``: DDP compares the hook's annotations with the real
``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Bounds the memory of records nobody drains (e.g. a loop that never calls on_step).
DEFAULT_MAX_PENDING = 8192


@dataclass(kw_only=True, slots=True)
class BucketTiming:
    """One bucket's allreduce, as measured on this rank."""

    step_seq: int
    """Value of :attr:`AllreduceTimer.step_seq` when the bucket was launched."""
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


class AllreduceTimer:
    """State of :func:`timed_allreduce_hook`: collects per-bucket timings until drained.

    Args:
        process_group: the DDP model's process group (``None``: the default group).
        use_cuda: time with CUDA events (gradients on GPU) instead of the monotonic clock.
        clock: monotonic clock, injectable for tests.
        max_pending: records kept at most before the oldest are dropped (and counted).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        use_cuda: bool = False,
        clock: Callable[[], float] = time.monotonic,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.process_group = process_group
        self.use_cuda = use_cuda
        self.clock = clock
        self.step_seq = 0
        self.dropped = 0
        self._max_pending = max_pending
        self._lock = threading.Lock()  # then-callbacks run on the backend's threads
        self._done: list[BucketTiming] = []
        self._cuda: list[_PendingCuda] = []

    def record_cpu(self, step_seq: int, nbytes: int, launched_s: float, done_s: float) -> None:
        """Store one completed CPU-timed bucket (called from the future's callback)."""
        timing = BucketTiming(
            step_seq=step_seq,
            nbytes=nbytes,
            duration_s=max(0.0, done_s - launched_s),
            launched_s=launched_s,
            done_s=done_s,
        )
        with self._lock:
            if len(self._done) >= self._max_pending:
                del self._done[0]
                self.dropped += 1
            self._done.append(timing)

    def add_cuda(self, pending: _PendingCuda) -> None:
        with self._lock:
            if len(self._cuda) >= self._max_pending:
                del self._cuda[0]
                self.dropped += 1
            self._cuda.append(pending)

    def next_step(self) -> None:
        """Mark a step boundary: buckets launched from now on belong to the next step."""
        self.step_seq += 1

    def drain(self) -> list[BucketTiming]:
        """Return and forget every finished timing, oldest first. Never blocks on the GPU."""
        with self._lock:
            done, self._done = self._done, []
            if not self._cuda:
                return done
            finished = 0
            for pending in self._cuda:
                # Collectives on one stream finish in launch order: stop at the first one
                # still running instead of querying (or waiting for) the rest.
                if pending.end is None or not pending.end.query():
                    break
                finished += 1
            ready, self._cuda = self._cuda[:finished], self._cuda[finished:]
        for pending in ready:
            done.append(
                BucketTiming(
                    step_seq=pending.step_seq,
                    nbytes=pending.nbytes,
                    duration_s=pending.start.elapsed_time(pending.end) / 1000.0,
                    launched_s=None,
                    done_s=None,
                )
            )
        return done


def _launch_allreduce(state: AllreduceTimer, buffer: torch.Tensor) -> torch.futures.Future[Any]:
    """What ``default_hooks.allreduce_hook`` does, minus its extra Python ``then`` callback:
    average the bucket over the group (divide first, as torch does, against fp16 overflow)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer.div_(group.size())  # type: ignore[union-attr]
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future()  # type: ignore[union-attr]


def timed_allreduce_hook(
    state: AllreduceTimer, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: torch's default allreduce, with the bucket's future timestamped.

    Register with ``ddp_model.register_comm_hook(AllreduceTimer(...), timed_allreduce_hook)``.
    One Python callback per bucket (the collective's own future), which also unwraps the result
    the way the default hook does.
    """
    buffer = bucket.buffer()
    nbytes = buffer.numel() * buffer.element_size()
    step_seq = state.step_seq
    if state.use_cuda:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        pending = _PendingCuda(step_seq=step_seq, nbytes=nbytes, start=start, end=None)
        fut = _launch_allreduce(state, buffer)

        def _cuda_done(f: torch.futures.Future[Any]) -> torch.Tensor:
            value = f.value()[0]  # raises if the collective failed: nothing is recorded then
            end = torch.cuda.Event(enable_timing=True)
            end.record()  # on the callback's stream, which waits for the collective
            pending.end = end
            state.add_cuda(pending)
            return value

        return fut.then(_cuda_done)

    launched = state.clock()
    fut = _launch_allreduce(state, buffer)

    def _cpu_done(f: torch.futures.Future[Any]) -> torch.Tensor:
        value = f.value()[0]
        state.record_cpu(step_seq, nbytes, launched, state.clock())
        return value

    return fut.then(_cpu_done)


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
