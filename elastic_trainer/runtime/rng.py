"""Random numbers of a training process: derived per step, so no state needs saving.

At the start of every optimizer step the runtime reseeds this process's generators (Python,
numpy, torch CPU and the worker's CUDA device) from ``(seed, rank, step)`` (:func:`seed_step`), so
whatever a step draws is a pure function of the job's seed, the rank and the step: a rank
restarted after any fault draws exactly what the uninterrupted run drew. :func:`capture` and
:func:`restore` remain for code that must leave no trace on the generators (DDP bucket priming).
Design: ``docs/design/exact-resume.md``.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

_np: Any
try:  # numpy is optional: seeded and checkpointed only when installed
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with most torch installs
    _np = None


def derive_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed from ``seed`` and ``parts`` (e.g. rank, step), stable across runs and hosts."""
    text = ":".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)


STEP_SCHEME = "per-step:sha256(seed:rank:step)"
"""What a checkpoint records instead of generator states (see the module docstring)."""


def seed_step(seed: int, rank: int, step: int, device: torch.device) -> None:
    """Reseed every generator this rank draws from for the step after ``step`` completed steps.

    No device synchronisation: only the CPU generator and this worker's CUDA generator are seeded
    (``torch.manual_seed`` would touch every device).
    """
    derived = derive_seed(seed, rank, step)
    random.seed(derived)
    if _np is not None:
        _np.random.seed(derived % (1 << 32))
    torch.default_generator.manual_seed(derived)
    if device.type == "cuda":
        torch.cuda.manual_seed(derived)  # the current device: the worker's


def seed_all(seed: int) -> None:
    """Seed python, numpy, torch CPU and all CUDA generators with ``seed``."""
    random.seed(seed)
    if _np is not None:
        _np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # also seeds every CUDA device


def capture(device: torch.device) -> dict[str, Any]:
    """This process's generator states (CUDA: only ``device``'s)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": (version, tuple(internal), gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": None,
    }
    if _np is not None:
        kind, keys, pos, has_gauss, cached = _np.random.get_state(legacy=True)
        state["numpy"] = (
            kind,
            torch.from_numpy(keys.astype("int64")),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
    """Inverse of :func:`capture`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    if _np is not None and state.get("numpy") is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        _np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
