"""Training state from a live peer: the checkpoint payload in three broadcasts, instead of a disk read.

The source rank splits the payload a checkpoint holds (model, optimizers, scheduler, scaler,
sampler, step, RNG) into its tensors and the rest. The rest -- containers (``OrderedDict`` and a
state dict's ``_metadata`` kept) and scalars, each tensor replaced by its index, plus every
tensor's dtype, shape and place -- is serialised with ``torch.save`` (a few kB; its size goes
first) and every rank loads it with ``weights_only=True``, as it would load the checkpoint file.
The tensors travel as their raw bytes, packed into one flat buffer, in one broadcast over a
host-side (gloo) group; each rank copies its tensors out of that buffer onto its own ``device``
(own storage each: a view would keep, and a later ``torch.save`` would write, the whole buffer).
Each broadcast is waited on through ``runtime/abortable.py``, so a round that opens meanwhile
ends it. Serialising the tensors too (``torch.save`` into memory and back) cost ten
times the broadcast itself: 4.3 s against 0.3 s for 600 MB (``benchmarks/restart_cost.py``).
Every member takes the state, the source included: a survivor's module buffers may have moved in
the forward of the step that failed, and the payload carries those of the last completed step.
"""

from __future__ import annotations

import io
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.runtime.abortable import AbortableWaits

log = logging.getLogger(__name__)

_TENSOR_KEY = "__elastic_trainer_tensor__"
"""The key of the one-entry dict that stands for tensor ``i`` in the serialised rest."""
_ALIGN = 64
"""Each tensor's bytes start at a multiple of this in the flat buffer (any dtype can view them)."""


def _split(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by ``{_TENSOR_KEY: index}`` (appended to ``tensors``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {_TENSOR_KEY: len(tensors) - 1}
    if isinstance(value, OrderedDict):
        return _ordered(value, (_split(item, tensors) for item in value.values()))
    if isinstance(value, dict):
        return {key: _split(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [_split(item, tensors) for item in value]
    if isinstance(value, tuple):
        return tuple(_split(item, tensors) for item in value)
    return value


def _ordered(like: OrderedDict[Any, Any], values: Iterable[Any]) -> OrderedDict[Any, Any]:
    """An ``OrderedDict`` of ``like``'s keys and ``values``, with its ``_metadata`` (a module
    state dict's versions, which ``load_state_dict`` reads)."""
    result = OrderedDict(zip(like.keys(), values, strict=True))
    metadata = getattr(like, "_metadata", None)
    if metadata is not None:
        result._metadata = metadata  # type: ignore[attr-defined]
    return result


def _join(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`_split`."""
    if isinstance(value, OrderedDict):
        return _ordered(value, (_join(item, tensors) for item in value.values()))
    if isinstance(value, dict):
        if len(value) == 1 and _TENSOR_KEY in value:
            return tensors[int(value[_TENSOR_KEY])]
        return {key: _join(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [_join(item, tensors) for item in value]
    if isinstance(value, tuple):
        return tuple(_join(item, tensors) for item in value)
    return value


def _layout(tensors: list[torch.Tensor]) -> tuple[list[tuple[str, list[int], int, int]], int]:
    """Each tensor's ``(dtype, shape, offset, nbytes)`` in the flat buffer, and the buffer's size."""
    layout, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        layout.append(
            (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes)
        )
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return layout, offset


def _broadcast(tensor: torch.Tensor, *, src: int, group: Any, waits: AbortableWaits) -> None:
    """One broadcast, waited on so that an abort ends it (``runtime/abortable.py``)."""
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    if work is not None:
        waits.track(work.get_future()).wait()


def _broadcast_bytes(data: bytes | None, *, src: int, group: Any, waits: AbortableWaits) -> bytes:
    size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
    _broadcast(size, src=src, group=group, waits=waits)
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(int(size[0]), dtype=torch.uint8)
    )
    _broadcast(buffer, src=src, group=group, waits=waits)
    return buffer.numpy().tobytes()


def share_state(
    payload: dict[str, Any] | None,
    *,
    src: int,
    device: torch.device,
    group: Any = None,
    waits: AbortableWaits | None = None,
) -> dict[str, Any]:
    """Collective: rank ``src`` passes ``payload`` (host tensors), every rank returns a copy on
    ``device``; its broadcasts are waited on through ``waits`` (the healer's: an abort ends them).

    Raises:
        RuntimeError: a peer failed during the transfer (the caller heals again), or what arrived
            is not a checkpoint payload.
    """
    started = time.monotonic()
    waits = waits if waits is not None else AbortableWaits()
    rank = dist.get_rank()
    header = None
    tensors: list[torch.Tensor] = []
    if rank == src:
        if payload is None:
            raise ValueError("the source rank has no state to share")
        rest = _split(payload, tensors)
        layout, total = _layout(tensors)
        buffer = io.BytesIO()
        torch.save({"rest": rest, "layout": layout, "total": total}, buffer)
        header = buffer.getvalue()
    meta = torch.load(
        io.BytesIO(_broadcast_bytes(header, src=src, group=group, waits=waits)), weights_only=True
    )
    if not isinstance(meta, dict) or not {"rest", "layout", "total"} <= meta.keys():
        raise RuntimeError("the shared state is not a checkpoint payload")
    flat = torch.empty(int(meta["total"]), dtype=torch.uint8)
    if rank == src:
        for tensor, (_, _, offset, nbytes) in zip(tensors, meta["layout"], strict=True):
            if nbytes:
                flat[offset : offset + nbytes].copy_(
                    tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                )
    if flat.numel():
        _broadcast(flat, src=src, group=group, waits=waits)
    received = []
    for dtype_name, shape, offset, nbytes in meta["layout"]:
        dtype = getattr(torch, dtype_name)
        if not isinstance(dtype, torch.dtype):
            raise RuntimeError(f"the shared state names an unknown dtype {dtype_name!r}")
        view = flat[offset : offset + nbytes].view(dtype).reshape(shape)
        received.append(view.clone() if device.type == "cpu" else view.to(device))
    state = _join(meta["rest"], received)
    if not isinstance(state, dict):
        raise RuntimeError("the shared state is not a checkpoint payload")
    log.info(
        "heal: state of step %s from rank %d: %.1f MB in %.3f s",
        state.get("step"),
        src,
        int(meta["total"]) / 1e6,
        time.monotonic() - started,
    )
    return state
