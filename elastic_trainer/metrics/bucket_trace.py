"""DDP bucket timings from the flight recorder, numbered by step, without a communication hook
(``ELASTIC_TRAINER_METRICS_ALLREDUCE=trace``).

:class:`TracedBucketTimer` gives the observer one :class:`BucketTiming` per bucket. A bucket is an allreduce of the model's group whose size DDP logged as a
bucket size; it belongs to the last synchronising forward that started before its launch (one
forward pre-hook). The ring is read once about half of it is new, at least every
:data:`MAX_READ_INTERVAL_S`. Only NCCL times its collectives: on gloo every bucket counts as
untimed. Design and costs: ``docs/design/metrics.md``.
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastic_trainer.metrics.collective_trace import (
    DEFAULT_BUFFER_ENTRIES,
    CollectiveTrace,
    TracedCollective,
    TraceFormatError,
)
from elastic_trainer.runtime import torch_compat
from elastic_trainer.runtime.settings import ENV_FR_BUFFER_SIZE

log = logging.getLogger(__name__)

MAX_REMEMBERED_STEPS = 4096
"""Forward start times kept (a bucket launched before the oldest kept is dropped)."""
HOLD_STEPS = 8
"""Steps a collective of unknown size waits for DDP to log its rebuilt bucket sizes."""
MAX_READ_INTERVAL_S = 10.0
"""Longest time between two reads of the recorder (while steps run)."""


@dataclass(kw_only=True, slots=True)
class BucketTiming:
    """One bucket's allreduce, as the recorder timed it on this rank."""

    step_seq: int
    """The step the bucket belongs to (:attr:`TracedBucketTimer.step_seq` when it was launched)."""
    nbytes: int
    """Size of the bucket's flat gradient buffer."""
    duration_s: float
    """Start to completion of the bucket's allreduce on the device."""


def exposed_wait_s(timings: list[BucketTiming]) -> float:
    """Time one step's buckets left exposed, estimated as its last bucket's duration.

    After the last bucket is launched the backward pass has nothing left to overlap with, so
    this is the communication time the step could not hide. In synchronous data parallelism it
    also holds the time this rank waited for slower peers: the straggler waits least.
    """
    return timings[-1].duration_s if timings else 0.0


def ddp_bucket_sizes(ddp_model: Any) -> tuple[set[int], bool]:
    """Bytes of every bucket DDP has logged (its first guess and, once logged, the rebuilt ones),
    and whether the rebuilt ones are among them."""
    data = torch_compat.ddp_logging_data(ddp_model)
    sizes: set[int] = set()
    for key in ("bucket_sizes", "rebuilt_bucket_sizes"):
        raw = data.get(key)
        if isinstance(raw, str):
            sizes.update(int(part) for part in raw.split(",") if part.strip())
    return sizes, isinstance(data.get("rebuilt_bucket_sizes"), str)


class TracedBucketTimer:
    """Bucket timings of one DDP model, read from the flight recorder (see the module docstring).

    Args:
        ddp_model: the ``DistributedDataParallel`` model; a forward pre-hook is registered on it.
        trace: the reader of the model's process group (default: a :class:`CollectiveTrace` of
            ``ddp_model.process_group``'s name).
        ring_entries: the recorder's ring size (the worker settings' ``TORCH_FR_BUFFER_SIZE``;
            default :data:`~elastic_trainer.metrics.collective_trace.DEFAULT_BUFFER_ENTRIES`).
        clock_ns: wall clock in ns, the recorder's (injectable for tests).
        clock: monotonic clock for :data:`MAX_READ_INTERVAL_S` (injectable for tests).
    """

    use_cuda = True
    """The observer pairs these timings with steps the way it pairs CUDA events: later."""

    def __init__(self, ddp_model: Any, *, trace: CollectiveTrace | None = None, ring_entries: int | None = None,
                 clock_ns: Callable[[], int] = time.time_ns,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._ddp = ddp_model
        if trace is None:
            trace = CollectiveTrace(ddp_model.process_group.group_name)
        self.trace = trace
        self._clock_ns = clock_ns
        self._clock = clock
        if ring_entries is None:
            ring_entries = DEFAULT_BUFFER_ENTRIES
        if ring_entries <= 0:
            log.warning("%s=%d turns torch's flight recorder off: the allreduce metrics stay empty",
                        ENV_FR_BUFFER_SIZE, ring_entries)  # fmt: skip
        self._half_ring = max(1, ring_entries // 2)
        self._per_step: float | None = None  # collectives of all groups per step; None: unknown
        self._read_step = 0  # step_seq at the last read
        self._read_s = -math.inf
        self._read_record = -1  # the recorder's newest record at the last read
        self._lost_at_read = 0
        self._broken = False  # a dump this reader cannot parse: no more reads
        self.step_seq = 0
        """Synchronising forwards started so far: the step number (from 0) of the buckets
        launched now."""
        self._starts: list[int] = []  # wall ns of the forwards of steps _first, _first + 1, ...
        self._first = 0
        self._early = 0
        self._held: list[tuple[int, TracedCollective]] = []  # (step, collective) of unknown size
        self._handle = ddp_model.register_forward_pre_hook(self._on_forward)

    @property
    def dropped(self) -> int:
        """Timings lost: collectives (of any group) overwritten in the recorder's ring before a
        read, and collectives launched before the oldest remembered forward."""
        return self.trace.lost + self._early

    def _on_forward(self, module: Any, _inputs: Any) -> None:
        if module.require_backward_grad_sync and torch.is_grad_enabled():
            self._starts.append(self._clock_ns())
            self.step_seq += 1

    def _read_due(self) -> bool:
        if self._broken:
            return False
        if self._per_step is None or self._clock() - self._read_s >= MAX_READ_INTERVAL_S:
            return True
        return (self.step_seq - self._read_step) * self._per_step >= self._half_ring

    def _read(self) -> list[TracedCollective]:
        trace = self.trace
        try:
            collectives = trace.read()
        except TraceFormatError as exc:  # metrics must never stop the training
            log.warning("allreduce timing from the flight recorder stops: %s", exc)
            self._broken = True
            return []
        steps = self.step_seq - self._read_step
        if trace.lost > self._lost_at_read:
            self._per_step = (
                None  # the ring wrapped between two reads: read every flush, learn again
            )
        elif steps > 0 and self._read_record >= 0:
            self._per_step = (trace.newest_record - self._read_record) / steps
        self._read_step, self._read_s = self.step_seq, self._clock()
        self._read_record, self._lost_at_read = trace.newest_record, trace.lost
        return collectives

    def remove(self) -> None:
        """Stop numbering forwards (the model is no longer observed)."""
        self._handle.remove()

    def drain(self) -> list[BucketTiming]:
        """The bucket allreduces found finished since the last call, oldest first, with their
        steps. Reads the recorder only when due (see the module docstring); never blocks on the GPU."""
        starts = self._starts
        if len(starts) > MAX_REMEMBERED_STEPS:
            cut = len(starts) - MAX_REMEMBERED_STEPS
            del starts[:cut]
            self._first += cut
        collectives = self._read() if self._read_due() else []
        if not collectives and not self._held:
            return []
        sizes, rebuilt = ddp_bucket_sizes(self._ddp)
        first = self._first
        candidates, self._held = self._held, []
        for c in collectives:
            index = bisect_right(starts, c.created_ns) - 1
            if index < 0:
                self._early += 1  # launched before the oldest remembered forward
            else:
                candidates.append((first + index, c))
        timings: list[BucketTiming] = []
        for step, c in candidates:
            if c.nbytes in sizes:
                timings.append(
                    BucketTiming(step_seq=step, nbytes=c.nbytes, duration_s=c.duration_s)
                )
            elif not rebuilt and step > self.step_seq - HOLD_STEPS:
                self._held.append(
                    (step, c)
                )  # perhaps a rebuilt bucket whose size DDP has not logged
            # else: not one of DDP's buckets (the runtime's control allreduce, ...)
        return timings
