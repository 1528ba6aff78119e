"""Host copies of the training state: what a checkpoint writer or a peer takes away.

The copy is taken on the training thread (or holding the state's guard), so the next optimizer
step can never change what is being written or sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from elastic_trainer.runtime import torch_compat


def snapshot_to_cpu(obj: Any, _seen: dict[tuple[Any, ...], torch.Tensor] | None = None) -> Any:
    """Deep copy of nested dicts/lists/tuples with every tensor copied to CPU memory; a tensor
    under several keys (tied weights) stays one tensor.

    The training thread calls this so that the background writer never reads tensors the next
    optimizer step is changing.
    """
    seen = {} if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        alias = (
            obj.device,
            obj.untyped_storage().data_ptr(),
            obj.storage_offset(),
            obj.shape,
            obj.stride(),
            obj.dtype,
        )
        if alias not in seen:
            seen[alias] = obj.detach().to("cpu", copy=True)
        return seen[alias]
    if isinstance(obj, dict):
        return {key: snapshot_to_cpu(value, seen) for key, value in obj.items()}
    if isinstance(obj, list):
        return [snapshot_to_cpu(value, seen) for value in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot_to_cpu(value, seen) for value in obj)
    return obj


def host_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """Host copy of a state dict that holds DTensors (each rank's local shards, with their mesh
    and placements, as DCP writes them): :func:`snapshot_to_cpu` for sharded state."""
    buffers = torch_compat.dcp_host_state_dict(state, pin_memory=False)
    return torch_compat.dcp_copy_state_dict(state, buffers, non_blocking=False)


def device_snapshot(
    build: Callable[[], Any],
    device: torch.device,
    after: torch.cuda.Event | None,
    copy: Callable[[Any], Any] = snapshot_to_cpu,
) -> Any:
    """CPU copy (``copy``: :func:`snapshot_to_cpu`) of the payload that ``build`` returns.

    On CUDA ``build`` and the copy run on a side stream that waits only for ``after`` (the end of
    the last update), not for work queued since (a hung collective); device work that ``build``
    queues (:meth:`AuthoritativeBuffers.snapshot`'s copies) is ordered after that update, and all
    of it has finished when this returns (the caller still holds the guard, so the next update
    cannot overwrite what was read).
    """
    if device.type != "cuda":
        return copy(build())
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        result = copy(build())
        stream.synchronize()
    return result
