"""The warm server's fork-safety check: an initialised CUDA driver refuses, a merely mapped one does not.

The real driver is asked in tests/gpu (a GPU is needed for that); here the decisions around it."""

from __future__ import annotations

from pathlib import Path

from elastic_trainer.warm_start import cuda_driver_initialized


def test_no_cuda_driver_mapped_is_safe_to_fork() -> None:
    maps = "7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    assert cuda_driver_initialized(maps) is False
    assert cuda_driver_initialized(Path("/proc/self/maps").read_text()) is False  # this machine: no GPU driver


def test_a_mapped_driver_that_cannot_be_asked_counts_as_initialised(tmp_path: Path) -> None:
    # Mapped (per the text) but not loaded in this process: RTLD_NOLOAD finds nothing to ask.
    maps = f"7f0000000000-7f0000001000 r-xp 00000000 08:01 42 {tmp_path}/libcuda.so.580.159.04\n"
    assert cuda_driver_initialized(maps) is True
