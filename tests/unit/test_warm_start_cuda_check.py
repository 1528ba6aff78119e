"""The warm server's fork-safety check: an initialised CUDA driver refuses, a merely mapped one does not.

The real driver is asked in tests/gpu (a GPU is needed for that); here the decisions around it,
with a fake loader in place of ``ctypes.CDLL``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic_trainer.launch.warm_start import CUDA_ERROR_NOT_INITIALIZED, cuda_driver_initialized

REPO = Path(__file__).resolve().parents[2]
LIBC = "7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
DRIVER = "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"


def _maps(*paths: str) -> str:
    return LIBC + "".join(f"7f0000002000-7f0000003000 r-xp 00000000 08:01 43 {p}\n" for p in paths)


class FakeLoader:
    """``ctypes.CDLL`` for the named libraries that are 'loaded', each answering ``cuCtxGetCurrent``."""

    def __init__(self, answers: dict[str, int]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, int]] = []

    def __call__(self, name: str, mode: int = 0) -> Any:
        self.asked.append((name, mode))
        if name not in self.answers:
            raise OSError(f"{name}: cannot open shared object file")
        answer = self.answers[name]

        class Driver:
            @staticmethod
            def cuCtxGetCurrent(context: object) -> int:  # noqa: N802 - the driver's name
                return answer

        return Driver()


def test_no_cuda_driver_mapped_is_safe_to_fork() -> None:
    loader = FakeLoader({})
    assert cuda_driver_initialized(LIBC, load=loader) is False
    assert loader.asked == []  # nothing mapped: the driver is not even looked for


def test_a_fresh_process_here_has_no_initialised_driver() -> None:
    probe = "from elastic_trainer.launch.warm_start import cuda_driver_initialized as f; print(f())"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.parametrize(
    ("answers", "initialised"),
    [
        ({"libcuda.so.1": CUDA_ERROR_NOT_INITIALIZED}, False),  # mapped at import, cuInit never ran
        ({"libcuda.so.1": 0}, True),  # cuInit ran (CUDA_SUCCESS, a context or not)
        ({"libcuda.so.1": 100}, True),  # any other answer: initialised enough to refuse
        ({DRIVER: CUDA_ERROR_NOT_INITIALIZED}, False),  # known by its path only
        ({}, True),  # mapped, but no copy can be asked: the safe answer
    ],
)
def test_the_loaded_driver_decides(answers: dict[str, int], initialised: bool) -> None:
    loader = FakeLoader(answers)
    assert cuda_driver_initialized(_maps(DRIVER), load=loader) is initialised
    assert loader.asked and all(
        mode & os.RTLD_NOLOAD for _, mode in loader.asked
    )  # never loads anything


def test_every_mapped_copy_is_asked() -> None:
    compat = "/usr/local/cuda/compat/libcuda.so.590.1 (deleted)"
    loader = FakeLoader({"libcuda.so.1": CUDA_ERROR_NOT_INITIALIZED, DRIVER: CUDA_ERROR_NOT_INITIALIZED,
                         "/usr/local/cuda/compat/libcuda.so.590.1": 0})  # fmt: skip
    assert cuda_driver_initialized(_maps(DRIVER, compat), load=loader) is True
    spaced = "/opt/my drivers/libcuda.so.1"
    loader = FakeLoader({spaced: CUDA_ERROR_NOT_INITIALIZED})
    assert cuda_driver_initialized(_maps(spaced), load=loader) is False
    assert loader.asked[-1][0] == spaced  # the whole path, spaces and all
