"""Allreduce timing without a comm hook: DDP's own runtime statistics, sampled in C++.

DDP's reducer times the backward of a sample of iterations (the first ten, then one in
``sample_every``) with its own C++ timer: when the first bucket's allreduce was launched, when the
backward's computation ended, and when the last bucket's allreduce finished. :class:`SampledDdpTimer`
reads them (``torch_compat.ddp_logging_data``, ~7 µs) when the observer flushes, at most once a
second, and keeps each new sample. Nothing runs on DDP's per-bucket path: the default, since a
Python comm hook on every bucket cost 13-21 % of a CPU MLP's step (issue 30,
``docs/design/metrics.md``).

What a sample gives: the step's allreduce span (first launch to last completion, all buckets),
its exposed wait (last completion minus the end of the backward's computation: the communication
the step could not hide, which holds the wait for slower peers) and the buckets' sizes. What it
does not: a duration per bucket, or every step (the observer applies the newest sample's exposed
wait to the steps around it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_trainer.runtime import torch_compat

DEFAULT_SAMPLE_EVERY = 10
"""DDP times one synchronised backward in this many (torch's default is 100). On CPU a sampled
iteration costs a few clock reads; on CUDA DDP synchronises its timing events on one, so CUDA
models keep torch's default."""


@dataclass(frozen=True, slots=True)
class DdpSample:
    """One backward that DDP timed."""

    iteration: int
    """DDP's count of synchronised forwards at the sample."""
    comm_s: float
    """First bucket's allreduce launched to the last one finished."""
    exposed_s: float
    """The last allreduce's end after the end of the backward's computation (0 when hidden)."""
    bucket_bytes: tuple[int, ...]
    """Each bucket's size."""


def _sizes(raw: Any) -> tuple[int, ...]:
    """DDP logs bucket sizes as ``"1052672, 26214400"``."""
    if isinstance(raw, str):
        return tuple(int(part) for part in raw.replace(",", " ").split())
    return ()


class SampledDdpTimer:
    """Reads a DDP model's sampled runtime statistics; see the module docstring.

    Args:
        ddp_model: the DDP model (built; its reducer times the sampled iterations).
        sample_every: DDP's sampling period (``None``: leave torch's).
    """

    use_cuda = False  # what the observer asks of any timer: this one never holds device events

    def __init__(self, ddp_model: Any, *, sample_every: int | None = DEFAULT_SAMPLE_EVERY) -> None:
        self._ddp = ddp_model
        if sample_every is not None:
            torch_compat.set_ddp_sample_rate(ddp_model, sample_every)
        self._last_end: int | None = None
        self.latest: DdpSample | None = None
        """The newest sample read (also after :meth:`poll` found nothing new)."""

    def poll(self) -> DdpSample | None:
        """A sample taken since the last call, or ``None``."""
        data = torch_compat.ddp_logging_data(self._ddp)
        end = int(data.get("backward_comm_time_end", 0) or 0)
        start = int(data.get("backward_comm_time_start", 0) or 0)
        compute_end = int(data.get("backward_compute_time_end", 0) or 0)
        if end <= 0 or start <= 0 or end == self._last_end:
            return None
        self._last_end = end
        sizes = _sizes(data.get("rebuilt_bucket_sizes")) or _sizes(data.get("bucket_sizes"))
        sample = DdpSample(
            iteration=int(data.get("iteration", 0) or 0),
            comm_s=max(0, end - start) / 1e9,
            exposed_s=max(0, end - compute_end) / 1e9 if compute_end > 0 else 0.0,
            bucket_bytes=sizes,
        )
        self.latest = sample
        return sample
