"""FSDP2 for a model: ``fully_shard`` on the blocks an :class:`FSDPOptions` names, then on the
whole model (``TrainerConfig(fsdp=FSDPOptions(...))`` has the Trainer do it: ``docs/design/sharded.md``).

    model = apply_fsdp(model, FSDPOptions(blocks=("blocks.*",), mixed_precision="bf16"), mesh)

Units are sharded children first (FSDP2 requires it), over the mesh given (1-D: FSDP; 2-D
``("replicate", "shard")``: HSDP). A name pattern that matches no module is a configuration error
before anything is sharded, not a silently unsharded block. Design: ``docs/design/sharded.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.train.config import FSDPOptions

__all__ = ["FSDPOptions", "apply_fsdp", "no_gradient_sync", "shard_model", "units"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _matches(name: str, pattern: str) -> bool:
    """``*`` stands for one whole segment of a dotted module name."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(
        w in ("*", p) for p, w in zip(parts, wanted, strict=True)
    )


def units(model: nn.Module, blocks: tuple[str, ...]) -> list[str]:
    """Names of the modules ``blocks`` selects, in ``named_modules`` order.

    Raises:
        ConfigError: a pattern selects nothing (the message lists a few module names), or a
            module without a forward of its own (a ``ModuleList``/``ModuleDict``, which
            ``fully_shard`` refuses; the message names its entries instead).
    """
    modules = {name: module for name, module in model.named_modules() if name}
    names = list(modules)
    for pattern in blocks:
        selected = [name for name in names if _matches(name, pattern)]
        if not selected:
            raise ConfigError(
                f"fsdp.blocks: {pattern!r} names no module of {type(model).__name__} "
                f"(its modules include {', '.join(names[:6])})"
            )
        for name in selected:
            if type(modules[name]).forward is nn.Module.forward:
                what = f"{pattern!r} is" if name == pattern else f"{pattern!r} selects {name!r},"
                raise ConfigError(
                    f"fsdp.blocks: {what} a {type(modules[name]).__name__} (no forward of its "
                    f"own): name its entries, e.g. '{name}.*'"
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


def shard_model(
    model: nn.Module, options: FSDPOptions, device: torch.device, world_size: int
) -> nn.Module:
    """:func:`apply_fsdp` over every rank of the current process group: a 1-D mesh (FSDP), or
    ``(replicas, world_size // replicas)`` with ``options.replicas`` > 1 (HSDP).

    Raises:
        ConfigError: ``options.replicas`` does not divide ``world_size``.
    """
    replicas = options.replicas
    if world_size % replicas:
        raise ConfigError(
            f"fsdp.replicas: {replicas} replicas do not divide the {world_size} workers of this "
            "attempt (HSDP needs world_size = replicas x shards)"
        )
    mesh = (
        init_device_mesh(device.type, (world_size,))
        if replicas == 1
        else init_device_mesh(
            device.type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard")
        )
    )
    return apply_fsdp(model, options, mesh)


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Backward accumulates unsharded gradients without reduce-scattering them (FSDP2's
    ``set_requires_gradient_sync(False)`` on every unit), as DDP's ``no_sync`` does."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)
