"""FSDP2 for a model: ``fully_shard`` on the blocks an :class:`FSDPOptions` names, then on the
whole model (the Trainer does not take FSDP models yet: ``docs/design/sharded.md``).

    model = apply_fsdp(model, FSDPOptions(blocks=("blocks.*",), mixed_precision="bf16"), mesh)

Units are sharded children first (FSDP2 requires it), over the mesh given (1-D: FSDP; 2-D
``("replicate", "shard")``: HSDP). A name pattern that matches no module is a configuration error
before anything is sharded, not a silently unsharded block. Design: ``docs/design/sharded.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.runtime.settings import check_bool
from elastic_trainer.train.config import MixedPrecision

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(kw_only=True, slots=True)
class FSDPOptions:
    """FSDP2 (``fully_shard``) for a model: each rank holds a shard of the parameters, gradients
    and optimizer state, and checkpoints are sharded (``docs/design/sharded.md``). Applied by
    :func:`apply_fsdp`."""

    blocks: tuple[str, ...] = ()
    """Module names sharded as their own units, in the order of ``named_modules``; ``*`` matches
    one name segment (``"blocks.*"`` is every child of ``blocks``, not their children). Then the
    whole model is one more unit. Each unit's parameters are gathered for its forward and backward
    only: name the repeated blocks (transformer layers)."""
    mixed_precision: MixedPrecision = "no"
    """``bf16`` / ``fp16``: parameters are cast to it for forward and backward, gradients are
    reduced in float32 (FSDP2's ``MixedPrecisionPolicy``); the sharded master copy stays float32."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (gathered again for the backward):
    less memory, one more all-gather per unit and step. ``False`` keeps them until the backward."""

    def __post_init__(self) -> None:
        if isinstance(self.blocks, str) or not all(
            isinstance(b, str) and b.strip() for b in self.blocks
        ):
            raise ConfigError(
                f"fsdp.blocks: must be a sequence of module names, got {self.blocks!r}"
            )
        self.blocks = tuple(self.blocks)
        if self.mixed_precision not in get_args(MixedPrecision):
            raise ConfigError(
                f"fsdp.mixed_precision: must be one of {', '.join(get_args(MixedPrecision))}, "
                f"got {self.mixed_precision!r}"
            )
        check_bool("fsdp.reshard_after_forward", self.reshard_after_forward)


def _matches(name: str, pattern: str) -> bool:
    """``*`` stands for one whole segment of a dotted module name."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(
        w in ("*", p) for p, w in zip(parts, wanted, strict=True)
    )


def units(model: nn.Module, blocks: tuple[str, ...]) -> list[str]:
    """Names of the modules ``blocks`` selects, in ``named_modules`` order.

    Raises:
        ConfigError: a pattern selects nothing (the message lists a few module names).
    """
    names = [name for name, _ in model.named_modules() if name]
    for pattern in blocks:
        if not any(_matches(name, pattern) for name in names):
            raise ConfigError(
                f"fsdp.blocks: {pattern!r} names no module of {type(model).__name__} "
                f"(its modules include {', '.join(names[:6])})"
            )
    return [name for name in names if any(_matches(name, pattern) for pattern in blocks)]


def apply_fsdp(model: nn.Module, options: FSDPOptions, mesh: Any) -> nn.Module:
    """Shard ``model`` in place as ``options`` says (see the module docstring); returns it."""
    selected = units(model, options.blocks)
    dtype = _DTYPES.get(options.mixed_precision)
    policy = MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None
    )
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": options.reshard_after_forward,
        "mp_policy": policy,
    }
    modules = dict(model.named_modules())
    for name in sorted(selected, key=lambda n: n.count("."), reverse=True):  # children first
        fully_shard(modules[name], **kwargs)
    fully_shard(model, **kwargs)
    return model
