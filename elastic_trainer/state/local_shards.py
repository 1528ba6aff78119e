"""One rank's own part of a sharded (FSDP2 / HSDP) state, as plain local tensors: what the
neighbour copy keeps and what a heal hands to a replacement.

    payload = local_state(model, [optimizer], {"sampler": sampler}, step=12)   # live references
    load_local_state(model, [optimizer], {"sampler": sampler}, payload)       # a model sharded anew

Every DTensor (a parameter's shard, AdamW's ``exp_avg`` of it) becomes ``{SHARD: local tensor}``;
everything else (replicated buffers, the optimizer's ``step`` scalars, its hyper-parameters, the
sampler's cursor) stays as it is. Loading puts each local tensor back into the DTensor of the
same name (model) or of the same parameter index (optimizers) on the *current* mesh, with no
collective: it needs the same world size and the same placement of this rank as when the payload
was taken (a heal in place keeps both; at another world size ``state/reshard.py`` first cuts the
payloads of the old world into this rank's, from the global shapes ``payload["layout"]`` records).
Design: ``docs/design/sharded.md`` ("Healing sharded state in place").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

SHARD = "__local_shard__"
"""The key of the one-entry dict that stands for a DTensor's local shard."""
FORMAT = "local-shards/1"
LAYOUT = "layout"
"""The payload's key of every shard's global shape and placement (:func:`local_state`)."""
DIM0 = "dim0"
"""The placement a reshard in place handles: dim 0 of a 1-D mesh, ``torch.chunk`` rows."""
HSDP_DIM0 = "replicate,dim0"
"""HSDP's: replicated on the first dim of a 2-D mesh, dim 0 in ``torch.chunk`` rows on the
second (each replica holds the same shards; a reshard cuts them over the shard dim)."""


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def placement_of(value: DTensor) -> str:
    """``"dim0"`` for a DTensor sharded on dim 0 of a 1-D mesh with ``torch.chunk`` rows (what
    FSDP2's ``fully_shard`` makes by default), :data:`HSDP_DIM0` for HSDP's (replicated, then
    dim 0) on a 2-D mesh, else a description of its placements."""
    placements = tuple(value.placements)
    only = placements[0] if value.device_mesh.ndim == 1 and len(placements) == 1 else None
    if type(only) is Shard and only.dim == 0:  # not _StridedShard (FSDP2 over tensor parallel)
        return DIM0
    if (
        value.device_mesh.ndim == 2
        and len(placements) == 2
        and type(placements[0]) is Replicate
        and type(placements[1]) is Shard
        and placements[1].dim == 0
    ):
        return HSDP_DIM0
    return f"{tuple(value.device_mesh.shape)} {placements}"


def _mark(value: Any, path: tuple[Any, ...], layout: dict[tuple[Any, ...], Any]) -> Any:
    if isinstance(value, DTensor):
        layout[path] = [list(value.shape), placement_of(value)]
        return {SHARD: value.to_local()}
    if isinstance(value, dict):
        return {key: _mark(item, (*path, key), layout) for key, item in value.items()}
    if isinstance(value, list):
        return [_mark(item, (*path, i), layout) for i, item in enumerate(value)]
    return value


def is_shard(value: Any) -> bool:
    """Whether ``value`` stands for a DTensor's local shard (``{SHARD: tensor}``)."""
    return isinstance(value, dict) and len(value) == 1 and SHARD in value


def local_state(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    objects: Mapping[str, Stateful | None],
    *,
    step: int,
) -> dict[str, Any]:
    """This rank's part of the state after ``step``: live references (copy before training on).

    ``payload[LAYOUT]`` maps the path of every shard (``("model", name)``, ``("optimizers", i,
    "state", index, key)``) to its global shape and :func:`placement_of`: what a reshard onto
    another world size needs (``state/reshard.py``); loading ignores it."""
    layout: dict[tuple[Any, ...], Any] = {}
    return {
        "format": FORMAT,
        "step": step,
        "model": {
            name: _mark(value, ("model", name), layout)
            for name, value in model.state_dict().items()
        },
        "optimizers": [
            _mark(optimizer.state_dict(), ("optimizers", i), layout)
            for i, optimizer in enumerate(optimizers)
        ],
        "objects": {
            name: None if obj is None else obj.state_dict() for name, obj in objects.items()
        },
        LAYOUT: layout,
    }


def _from_local(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(like, DTensor):
        raise ValueError("a shard where the live state holds a plain tensor")
    return DTensor.from_local(
        local.to(like.device).clone(),
        device_mesh=like.device_mesh,
        placements=like.placements,
        shape=like.shape,
        stride=like.stride(),
        run_check=False,
    )


def load_local_state(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    objects: Mapping[str, Stateful | None],
    payload: Mapping[str, Any],
) -> int:
    """Restore ``payload`` (:func:`local_state` of this rank's place) into the live objects;
    returns its step.

    Raises:
        ValueError: it is not a local-shards payload, or it does not fit the live model.
    """
    if payload.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} payload")
    saved = payload["model"]
    live = model.state_dict()
    if saved.keys() != live.keys():
        raise ValueError("the shard payload names other model entries than the live model")
    with torch.no_grad():
        for name, target in live.items():
            value = saved[name]
            destination = target.to_local() if isinstance(target, DTensor) else target
            source = value[SHARD] if is_shard(value) else value
            if destination.shape != source.shape:
                raise ValueError(
                    f"model entry {name!r}: shard of shape {tuple(source.shape)}, "
                    f"live {tuple(destination.shape)} (another world size or placement)"
                )
            destination.copy_(source)
    if len(payload["optimizers"]) != len(optimizers):
        raise ValueError("the shard payload holds another number of optimizers")
    for optimizer, state in zip(optimizers, payload["optimizers"], strict=True):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        rebuilt = {
            index: {
                key: _from_local(value[SHARD], params[int(index)]) if is_shard(value) else value
                for key, value in entry.items()
            }
            for index, entry in state["state"].items()
        }
        optimizer.load_state_dict({"state": rebuilt, "param_groups": state["param_groups"]})
    for name, obj in objects.items():
        value = payload["objects"].get(name)
        if obj is not None and value is not None:
            obj.load_state_dict(value)
    return int(payload["step"])
