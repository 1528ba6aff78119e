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

from elastic_trainer.state import local_shards

MODEL, OPTIMIZER = "model", "optimizer"
"""The payload keys of the model and of all its optimizers together."""


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters (``fully_shard``, tensor parallel)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


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
        self.owns = frozenset({MODEL, *(names or {OPTIMIZER: None})})
        """The names this state restores through DCP's state-dict API (the model, the optimizers)."""

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
