"""A payload (nested dicts, lists, tuples of tensors and plain values) as one flat byte buffer
plus a small header: how the heal path sends a state to a peer and how the neighbour copy keeps
one in host memory.

    packed = pack(payload)                    # tensors found, header serialised (a few kB)
    flat = torch.empty(packed.total, dtype=torch.uint8)
    fill(packed, flat)                        # every tensor's bytes, one copy each
    payload = unpack(packed.header, flat, torch.device("cpu"))   # weights_only=True

Invariant: the header is read with ``torch.load(weights_only=True)``, as a checkpoint file is:
containers (``OrderedDict`` with a state dict's ``_metadata`` kept) and scalars only, each tensor
replaced by its index. Each tensor's bytes start at a multiple of :data:`ALIGN` in the buffer.
Unpacked tensors own their storage (a view would keep, and a later ``torch.save`` would write,
the whole buffer). Used by ``heal/state_transfer.py`` and ``state/neighbour_copy.py``.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

TENSOR_KEY = "__elastic_trainer_tensor__"
"""The key of the one-entry dict that stands for tensor ``i`` in the serialised rest."""
ALIGN = 64
"""Each tensor's bytes start at a multiple of this in the flat buffer (any dtype can view them)."""

Layout = list[tuple[str, list[int], int, int]]
"""Each tensor's ``(dtype, shape, offset, nbytes)``."""


def split(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by ``{TENSOR_KEY: index}`` (appended to ``tensors``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {TENSOR_KEY: len(tensors) - 1}
    if isinstance(value, OrderedDict):
        return _ordered(value, (split(item, tensors) for item in value.values()))
    if isinstance(value, dict):
        return {key: split(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [split(item, tensors) for item in value]
    if isinstance(value, tuple):
        return tuple(split(item, tensors) for item in value)
    return value


def _ordered(like: OrderedDict[Any, Any], values: Iterable[Any]) -> OrderedDict[Any, Any]:
    """An ``OrderedDict`` of ``like``'s keys and ``values``, with its ``_metadata`` (a module
    state dict's versions, which ``load_state_dict`` reads)."""
    result = OrderedDict(zip(like.keys(), values, strict=True))
    metadata = getattr(like, "_metadata", None)
    if metadata is not None:
        result._metadata = metadata  # type: ignore[attr-defined]
    return result


def join(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split`."""
    if isinstance(value, OrderedDict):
        return _ordered(value, (join(item, tensors) for item in value.values()))
    if isinstance(value, dict):
        if len(value) == 1 and TENSOR_KEY in value:
            return tensors[int(value[TENSOR_KEY])]
        return {key: join(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [join(item, tensors) for item in value]
    if isinstance(value, tuple):
        return tuple(join(item, tensors) for item in value)
    return value


def layout_of(tensors: list[torch.Tensor]) -> tuple[Layout, int]:
    """Each tensor's place in the flat buffer, and the buffer's size."""
    layout, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        layout.append(
            (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes)
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    return layout, offset


@dataclass(slots=True)
class Packed:
    """A payload split into its header (serialised rest and layout) and its tensors."""

    header: bytes
    tensors: list[torch.Tensor]
    layout: Layout
    total: int
    """Bytes of the flat buffer."""


def pack(payload: Any, *, rest: Any = None) -> Packed:
    """Split ``payload``; ``rest`` (from :func:`split`, with ``tensors``) skips the walk."""
    tensors: list[torch.Tensor] = []
    structure = split(payload, tensors)
    layout, total = layout_of(tensors)
    buffer = io.BytesIO()
    torch.save({"rest": structure, "layout": layout, "total": total}, buffer)
    return Packed(header=buffer.getvalue(), tensors=tensors, layout=layout, total=total)


def fill(packed: Packed, flat: torch.Tensor, *, non_blocking: bool = False) -> None:
    """Copy every tensor's bytes into ``flat`` (host memory, at least ``packed.total`` bytes)."""
    for tensor, (_, _, offset, nbytes) in zip(packed.tensors, packed.layout, strict=True):
        if nbytes:
            flat[offset : offset + nbytes].copy_(
                tensor.detach().contiguous().reshape(-1).view(torch.uint8),
                non_blocking=non_blocking,
            )


def read_header(header: bytes) -> dict[str, Any]:
    """The header, loaded with ``weights_only=True``.

    Raises:
        RuntimeError: it is not a packed payload's header.
    """
    meta = torch.load(io.BytesIO(header), weights_only=True)
    if not isinstance(meta, dict) or not {"rest", "layout", "total"} <= meta.keys():
        raise RuntimeError("not a packed state payload")
    return meta


def unpack(meta: dict[str, Any], flat: torch.Tensor, device: torch.device) -> Any:
    """The payload of ``meta`` (:func:`read_header`) and ``flat``, each tensor copied onto ``device``."""
    received = []
    for dtype_name, shape, offset, nbytes in meta["layout"]:
        dtype = getattr(torch, dtype_name)
        if not isinstance(dtype, torch.dtype):
            raise RuntimeError(f"the packed state names an unknown dtype {dtype_name!r}")
        view = flat[offset : offset + nbytes].view(dtype).reshape(shape)
        received.append(view.clone() if device.type == "cpu" else view.to(device))
    return join(meta["rest"], received)
