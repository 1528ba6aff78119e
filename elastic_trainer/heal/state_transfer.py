"""Training state from a live peer: one broadcast of the checkpoint payload, instead of a disk read.

The source rank serialises the same payload a checkpoint holds (``torch.save`` into memory: model,
optimizers, scheduler, scaler, sampler, step; plain tensors and containers only) and broadcasts
its length and bytes over a host-side (gloo) group; every rank loads it back with
``weights_only=True`` and its own ``map_location``, exactly as it would load the checkpoint file.
Every member loads it, the source included: a survivor's module buffers may have moved in the
forward of the step that failed, and the payload carries those of the last completed step.
"""

from __future__ import annotations

import io
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def share_state(payload: dict[str, Any] | None, *, src: int, device: torch.device, group: Any = None) -> dict[str, Any]:
    """Collective: rank ``src`` passes ``payload`` (host tensors), every rank returns a copy on
    ``device``.

    Raises:
        RuntimeError: a peer failed during the transfer (the caller heals again).
    """
    started = time.monotonic()
    rank = dist.get_rank()
    size = torch.zeros(1, dtype=torch.int64)
    data = torch.empty(0, dtype=torch.uint8)
    if rank == src:
        if payload is None:
            raise ValueError("the source rank has no state to share")
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        size[0] = data.numel()
    dist.broadcast(size, src=src, group=group)
    if rank != src:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    state = torch.load(io.BytesIO(data.numpy().tobytes()), map_location=device, weights_only=True)
    if not isinstance(state, dict):
        raise RuntimeError("the shared state is not a checkpoint payload")
    log.info("heal: state of step %s from rank %d: %.1f MB in %.3f s", state.get("step"), src,
             int(size[0]) / 1e6, time.monotonic() - started)
    return state
