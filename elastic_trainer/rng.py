"""Random-number state: seeding, capture and restore, as plain data a checkpoint can hold.

Captured states contain only ints, floats, None, tuples and CPU tensors, so they load with
``torch.load(..., weights_only=True)``.
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
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
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
