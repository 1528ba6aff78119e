"""Sharded (FSDP2 / DTensor) training state, read and written through
``torch.distributed.checkpoint.state_dict``.

    state = ShardedState(model, [optimizer], objects={"sampler": sampler, "scheduler": scheduler})
    payload = state.state_dict()      # {"model": DTensors, "optimizer": DTensors, "sampler": ..., ...}
    state.load_state_dict(payload)    # after DCP filled ``payload`` in place, resharded

Invariant: a rank only ever holds its own shards. ``get_state_dict`` returns the model and
optimizer state as DTensors keyed by parameter name (FQN), so a checkpoint written at N ranks maps
onto M ranks; ``set_state_dict`` puts a loaded one back. Nothing here gathers a full state on one
rank (``export`` does that offline). Plain objects (sampler, schedulers, scaler) keep their own
``state_dict``: they are the same on every rank. Design: ``docs/design/sharded.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from elastic_trainer.runtime import torch_compat
from elastic_trainer.state import local_shards

MODEL, OPTIMIZER = "model", "optimizer"
"""The payload keys of the model and of all its optimizers together."""


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters (``fully_shard``, tensor parallel)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def mesh_replicas(model: nn.Module) -> int:
    """Replicas of each shard, from the parameters' placements: 1 for FSDP (dim 0 of a 1-D
    mesh), the replicate dimension's size for HSDP (replicated, then dim 0, on a 2-D mesh), 0 for
    any other layout (tensor parallel, a mix), which no neighbour copy or placed save handles."""
    found = {
        (local_shards.placement_of(p), tuple(p.device_mesh.shape))
        for p in model.parameters()
        if isinstance(p, DTensor)
    }
    if len(found) != 1:
        return 0
    ((placement, shape),) = found
    if placement == local_shards.DIM0:
        return 1
    return int(shape[0]) if placement == local_shards.HSDP_DIM0 else 0


class ShardedState:
    """A sharded model, its optimizers and plain objects, as one DCP state dict.

    Args:
        model: the sharded module (``fully_shard`` applied).
        optimizers: every optimizer over its parameters (saved together under ``"optimizer"``,
            keyed by parameter name).
        objects: other state by name (sampler, schedulers, scaler): saved with their own
            ``state_dict``; names ``model`` and ``optimizer`` are taken.
        names: the names the optimizers go by elsewhere (a ``TrainingState``'s ``optimizer``,
            ``optimizer_1``, ...): they are all restored by the one ``optimizer`` entry.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        objects: Mapping[str, Stateful | None] | None = None,
        *,
        names: Mapping[str, Any] | None = None,
    ) -> None:
        if not is_sharded(model):
            raise ValueError(
                "model: no DTensor parameters; apply fully_shard first (a DDP model takes the "
                "single-file checkpoints)"
            )
        taken = {MODEL, OPTIMIZER} & set(objects or {})
        if taken:
            raise ValueError(
                f"objects: {sorted(taken)} are the names of the model and its optimizers"
            )
        self.model = model
        self.optimizers = list(optimizers)
        self.objects: dict[str, Stateful | None] = dict(objects or {})
        self._options = StateDictOptions()
        self._names: tuple[dict[str, str], list[str]] | None = None
        self.owns = frozenset({MODEL, *(names or {OPTIMIZER: None})})
        """The names this state restores through DCP's state-dict API (the model, the optimizers)."""
        self.replicas = mesh_replicas(model)
        """1: FSDP; R > 1: HSDP with R replicas of each shard; 0: another layout
        (:func:`mesh_replicas`)."""

    def state_dict(self) -> dict[str, Any]:
        """Live DTensors of this rank's shards and the plain objects' states (copy before training on)."""
        model_state, optimizer_state = get_state_dict(
            self.model, self.optimizers, options=self._options
        )
        payload: dict[str, Any] = {MODEL: model_state, OPTIMIZER: optimizer_state}
        for name, obj in self.objects.items():
            payload[name] = None if obj is None else obj.state_dict()
        return payload

    def local_state(self, step: int) -> dict[str, Any]:
        """This rank's own shards and the plain objects after ``step``, as local tensors (live
        references): what the neighbour copy keeps (``state/local_shards.py``)."""
        return local_shards.local_state(self.model, self.optimizers, self.objects, step=step)

    def load_local_state(self, payload: Mapping[str, Any]) -> int:
        """Put back a :meth:`local_state` of this rank's place (a heal in place), no collective;
        returns its step."""
        return local_shards.load_local_state(self.model, self.optimizers, self.objects, payload)

    def checkpoint_names(self) -> tuple[dict[str, str], list[str]]:
        """The names ``get_state_dict`` gives (found without calling it: on an optimizer with no
        state yet it takes a step to make some): each ``model.state_dict()`` entry's, and every
        parameter's in the optimizers' order (their groups one after another, as a payload
        numbers them per optimizer). Taken once; take it on the training thread (reading the
        model's state dict on another thread while it trains is not safe)."""
        if self._names is None:
            entries = {
                name: torch_compat.dcp_fqn(self.model, name) for name in self.model.state_dict()
            }
            by_param = {id(p): name for name, p in self.model.named_parameters()}
            names = [
                torch_compat.dcp_fqn(self.model, by_param[id(p)])
                for optimizer in self.optimizers
                for group in optimizer.param_groups
                for p in group["params"]
            ]
            self._names = (entries, names)
        return self._names

    def checkpoint_state(
        self, payload: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[int, tuple[list[int], str]]]:
        """A :meth:`local_state` payload (this rank's place or another's: a neighbour copy) in the
        shape of :meth:`state_dict`, as a checkpoint writes it: the same names, each shard a plain
        tensor where the live state holds a DTensor. Also returns, for each of those tensors (by
        ``id``), its global shape and placement (``local_shards.placement_of``), from which the
        writer places it (``checkpoint/sharded_jit.py``).

        Raises:
            ValueError: it is not a local-shards payload of this model and these optimizers.
        """
        if payload.get("format") != local_shards.FORMAT:
            raise ValueError(f"not a {local_shards.FORMAT} payload")
        layout = payload.get(local_shards.LAYOUT) or {}
        placed: dict[int, tuple[list[int], str]] = {}

        def plain(value: Any, path: tuple[Any, ...]) -> Any:
            if not local_shards.is_shard(value):
                return value
            if path not in layout:
                raise ValueError(f"{'.'.join(map(str, path))}: a shard without its layout")
            shape, placement = layout[path]
            tensor = value[local_shards.SHARD]
            placed[id(tensor)] = (list(shape), str(placement))
            return tensor

        entries, names = self.checkpoint_names()
        saved = payload["model"]
        if saved.keys() != entries.keys():
            raise ValueError("the shard payload names other model entries than the live model")
        model = {entries[name]: plain(value, ("model", name)) for name, value in saved.items()}
        if len(payload["optimizers"]) != len(self.optimizers):
            raise ValueError("the shard payload holds another number of optimizers")
        state: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for i, optimizer_payload in enumerate(payload["optimizers"]):
            count = sum(len(group["params"]) for group in optimizer_payload["param_groups"])
            if offset + count > len(names):
                raise ValueError("the shard payload holds more parameters than the optimizers")
            for index, entry in optimizer_payload["state"].items():
                state[names[offset + int(index)]] = {
                    key: plain(value, ("optimizers", i, "state", index, key))
                    for key, value in entry.items()
                }
            for group in optimizer_payload["param_groups"]:
                groups.append(
                    {**group, "params": [names[offset + int(p)] for p in group["params"]]}
                )
            offset += count
        if offset != len(names):
            raise ValueError("the shard payload holds fewer parameters than the optimizers")
        result: dict[str, Any] = {MODEL: model, OPTIMIZER: {"state": state, "param_groups": groups}}
        for name in self.objects:
            result[name] = payload["objects"].get(name)
        return result, placed

    def load_state_dict(self, payload: Mapping[str, Any]) -> None:
        """Restore from ``payload`` (a :meth:`state_dict` that DCP loaded into)."""
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=payload[MODEL],
            optim_state_dict=payload[OPTIMIZER],
            options=self._options,
        )
        for name, obj in self.objects.items():
            if obj is not None and payload.get(name) is not None:
                obj.load_state_dict(payload[name])
