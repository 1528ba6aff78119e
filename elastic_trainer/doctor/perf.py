"""Measurements for ``elastic-trainer doctor``: allreduce latency and bus bandwidth, and the
compute/communication ratio of one training step.

Bandwidth as nccl-tests defines it (``algbw = S / t``, ``busbw = algbw * 2(n-1)/n``, GB = 10^9
bytes); CUDA events on a GPU, ``time.perf_counter`` after a barrier on the CPU; the slowest rank's
time is reported. Design: ``docs/design/doctor.md``.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

MIN_MESSAGE_BYTES = 4
MAX_MESSAGE_BYTES = 1 << 30
"""1 GiB: beyond that a diagnostic run starts to compete with the job for memory."""
MAX_SIZES = 64
DEFAULT_SIZES = "1K..64M"
ELEMENT_BYTES = 4
"""Messages are float32 tensors, as DDP's gradient buckets usually are."""

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64K"`` / ``"64KB"`` / ``"64KiB"`` / ``"65536"`` -> 65536 (binary units, as nccl-tests).

    Raises:
        ValueError: not a size.
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (examples: 4096, 1K, 64M)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """Message sizes in bytes from ``MIN..MAX[:FACTOR]`` or a comma-separated list.

    ``1K..64M`` doubles from 1 KiB to 64 MiB (nccl-tests' ``-b 1K -e 64M -f 2``); ``1K..64M:4``
    multiplies by 4; ``1K,64K,1M`` measures exactly those.

    Raises:
        ValueError: malformed text, a size that is not a positive multiple of 4 bytes, above
            1 GiB, or more than 64 sizes.
    """
    text = text.strip()
    if ".." in text:
        low_text, _, rest = text.partition("..")
        high_text, colon, factor_text = rest.partition(":")
        low, high = parse_size(low_text), parse_size(high_text)
        factor = 2
        if colon:
            if not factor_text.strip().isdigit() or int(factor_text) < 2:
                raise ValueError(f"factor {factor_text!r} in {text!r} must be an integer >= 2")
            factor = int(factor_text)
        if low > high:
            raise ValueError(f"{text!r}: the first size is larger than the last")
        if low < 1:
            raise ValueError(f"{text!r}: sizes must be positive")
        # One more than allowed at most, so that a range too long is reported below.
        steps = (low * factor**i for i in range(MAX_SIZES + 1))
        sizes = list(itertools.takewhile(lambda size: size <= high, steps))
    else:
        sizes = [parse_size(part) for part in text.split(",")] if text else []
    if not sizes:
        raise ValueError("no sizes given (example: 1K..64M)")
    if len(sizes) > MAX_SIZES:
        raise ValueError(f"{text!r} gives more than {MAX_SIZES} sizes")
    for size in sizes:
        if size < MIN_MESSAGE_BYTES or size % ELEMENT_BYTES:
            raise ValueError(
                f"size {size} B: must be a positive multiple of {ELEMENT_BYTES} bytes (float32)"
            )
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"size {size} B: above the 1 GiB limit")
    return sorted(set(sizes))


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s: bytes of the message over the time of one allreduce."""
    if seconds <= 0:
        raise ValueError(f"seconds: must be positive, got {seconds}")
    return size_bytes / seconds / 1e9


def busbw_factor(world_size: int) -> float:
    """nccl-tests' allreduce correction ``2(n-1)/n`` (0 for one rank: nothing crosses a link)."""
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    return 2 * (world_size - 1) / world_size


@dataclass(kw_only=True, slots=True)
class BandwidthRow:
    """One line of the bandwidth table."""

    size_bytes: int
    count: int
    """float32 elements."""
    time_us: float
    """Mean time of one allreduce on the slowest rank, microseconds."""
    algbw_gbps: float
    busbw_gbps: float

    @classmethod
    def from_time(cls, size_bytes: int, seconds: float, world_size: int) -> BandwidthRow:
        """The row of one allreduce of ``size_bytes`` that took ``seconds`` (busbw = algbw * 2(n-1)/n)."""
        algbw = algbw_gbps(size_bytes, seconds)
        return cls(
            size_bytes=size_bytes,
            count=size_bytes // ELEMENT_BYTES,
            time_us=seconds * 1e6,
            algbw_gbps=algbw,
            busbw_gbps=algbw * busbw_factor(world_size),
        )


def compute_comm_ratio(compute_s: float, comm_s: float) -> float:
    """Forward+backward time over gradient-allreduce time: above 1 the step is compute-bound and
    DDP can hide the allreduce behind the backward pass; the DDP guide aims for 10 or more."""
    if compute_s <= 0 or comm_s <= 0:
        raise ValueError(f"times must be positive, got compute {compute_s} s, comm {comm_s} s")
    return compute_s / comm_s


# --- timing (needs a process group) ----------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_loop(fn: Callable[[], object], *, iters: int, warmup: int, device: torch.device) -> float:
    """Mean seconds per call of ``fn`` on this rank (CUDA events on a GPU, perf_counter else),
    after a barrier when a process group exists."""
    for _ in range(warmup):
        fn()
    _synchronize(device)
    if dist.is_initialized():
        barrier(device)  # start together: the time measures this rank's work, not a late peer
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - began) / iters


def barrier(device: torch.device) -> None:
    """``dist.barrier`` on this rank's GPU with NCCL (so NCCL need not guess the device)."""
    if device.type == "cuda" and dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds`` (an allreduce MAX, so every rank gets it)."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def time_allreduce(size_bytes: int, *, iters: int, warmup: int, device: torch.device) -> float:
    """Seconds per allreduce of ``size_bytes`` of float32 on the slowest rank."""
    # Zeros: repeated in-place sums of zeros never overflow, whatever the world size.
    buffer = torch.zeros(size_bytes // ELEMENT_BYTES, dtype=torch.float32, device=device)
    seconds = time_loop(lambda: dist.all_reduce(buffer), iters=iters, warmup=warmup, device=device)
    return slowest(seconds, device)


def measure_bandwidth(
    sizes: list[int], *, iters: int, warmup: int, device: torch.device, world_size: int
) -> list[BandwidthRow]:
    """The bandwidth table for ``sizes`` (every rank must call it with the same arguments)."""
    return [
        BandwidthRow.from_time(
            size, time_allreduce(size, iters=iters, warmup=warmup, device=device), world_size
        )
        for size in sizes
    ]
