"""The step's control carried by an FSDP2 reduce-scatter: no collective of its own for a sharded model.

    carrier = ShardCarrier.maybe(model, env)      # None where it does not apply
    channel = ControlChannel(env, carrier=carrier)
    ...
    carrier.close()                               # the unit's own reduce-scatter again

The DDP route carries the control as the gradient of an extra parameter
(:mod:`elastic_trainer.runtime.grad_carrier`). FSDP2 has no such carrier: it reduce-scatters
gradients, so an extra parameter would be sharded, not summed on every rank, and it would be a
unit's state. Here the control rides on the reduce-scatter of one FSDP unit instead (the one with
the fewest parameters), through FSDP2's public ``set_custom_reduce_scatter``: the unit's
reduce-scatter input (one row of ``C`` values per rank) is copied into a reused ``(W, C + n)``
buffer whose last ``n`` columns hold this rank's control in every row, and one reduce-scatter of
it gives each rank its row's sum (the gradient shard FSDP expects, written straight into the
output FSDP allocated, which has room for the ``n`` values after it) and, in the ``n`` values,
the sum of every rank's control: an all-reduce that costs a copy of one unit's gradient. A
collective of its own costs each rank far more CPU on gloo (waking its threads, measured in
``benchmarks/RESULTS.md``), so units above :data:`MAX_CARRY_NUMEL` values do not carry.

Encoding, as the DDP carrier's: every slot is an integer times the world size ``w`` (exact in
float32), so FSDP's averaging (``AVG``: the sum divided by ``w``) or its summing leaves it exact;
a ``carried`` slot proves that every rank's payload travelled (its sum must be ``w``); the loss
travels as two float32 halves. No buffers ride (a sharded model's buffers are not synchronised by
the control: ``docs/design/sharded.md``).

Invariants: the carrying reduce-scatter runs with the ``n`` extra values on every rank whether a
payload is aboard or not (zeros then), so its shape never depends on the step; a payload that no
reduce-scatter took (the control started after the backward, or a unit that took no part in it)
is taken back and the control goes on its own collective, on every rank alike, and from then on
every control does (:meth:`ShardCarrier.fits`); only a float32 (or float64) reduction over a 1-D
mesh of every rank carries (HSDP, mixed-precision reduction and custom divide factors do not).
Design: ``docs/design/sharded.md``, "The step's control".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from elastic_trainer.runtime import control_header, torch_compat
from elastic_trainer.runtime.distributed import DistEnv

_SLOTS = control_header.HEADER_SLOTS
MAX_CARRY_NUMEL = 1 << 21
"""The largest unit (parameters) that carries: copying its gradient (8 MB in float32, ~0.3 ms on
a 2-core VM) must cost less than the collective it saves."""
_CARRYING_DTYPES = (torch.float32, torch.float64)


def _own_parameters(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP manages in ``unit``'s own group: not those of a unit inside it."""
    inner = {
        id(p)
        for m in unit.modules()
        if m is not unit and torch_compat.is_fsdp_unit(m)
        for p in m.parameters()
    }
    return [p for p in unit.parameters() if id(p) not in inner]


def carrying_unit(model: nn.Module, world_size: int) -> nn.Module | None:
    """The FSDP unit of ``model`` whose reduce-scatter carries the control: the one with the
    fewest trainable parameters, sharded over a 1-D mesh of ``world_size`` ranks, on its default
    reduce-scatter, at most :data:`MAX_CARRY_NUMEL` values; ``None`` when no unit qualifies.
    Alike on every rank (it reads the model's structure only)."""
    best: tuple[int, nn.Module] | None = None
    for module in model.modules():
        if not torch_compat.is_fsdp_unit(module) or not torch_compat.fsdp_default_reduce_scatter(
            module
        ):
            continue
        params = [p for p in _own_parameters(module) if p.requires_grad]
        if not params:
            continue
        meshes = [getattr(p, "device_mesh", None) for p in params]
        if any(m is None or m.ndim != 1 or m.size() != world_size for m in meshes):
            continue
        numel = sum(p.numel() for p in params)
        if numel <= MAX_CARRY_NUMEL and (best is None or numel < best[0]):
            best = (numel, module)
    return best[1] if best is not None else None


class _CarryingReduceScatter:
    """FSDP2's reduce-scatter comm of the carrying unit (the ``ReduceScatter`` interface:
    ``allocate`` and ``__call__``)."""

    def __init__(self, carrier: ShardCarrier) -> None:
        self._carrier = carrier
        self._ext: torch.Tensor | None = None
        self._last: torch.Tensor | None = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``size`` with room for the control after it (FSDP allocates the
        reduce-scatter's input, then its output, just before the call)."""
        numel = math.prod(int(s) for s in size)
        full = torch.empty(numel + _SLOTS, dtype=dtype, device=device)
        self._last = full
        return full[:numel].view(*size)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        full, self._last = self._last, None
        world = group.size()
        chunk = output_tensor.numel()
        if (
            async_op
            or world != self._carrier.world_size
            or input_tensor.dtype not in _CARRYING_DTYPES
            or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
            or full is None
            or full.data_ptr() != output_tensor.data_ptr()
            or full.numel() != chunk + _SLOTS
            or input_tensor.numel() != world * chunk
        ):  # alike on every rank: FSDP calls every rank's unit with the same shapes and op
            return dist.reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        ext = self._ext
        if ext is None or ext.shape != (world, chunk + _SLOTS) or ext.dtype != input_tensor.dtype:
            ext = self._ext = torch.empty(
                (world, chunk + _SLOTS), dtype=input_tensor.dtype, device=input_tensor.device
            )
        ext[:, :chunk].copy_(input_tensor.view(world, chunk))
        payload = self._carrier._take()
        if payload is None:
            ext[:, chunk:].zero_()
        else:
            ext[:, chunk:].copy_(torch.from_numpy(payload))  # the same row for every rank
        dist.reduce_scatter_single(full, ext.view(-1), op=op, group=group)
        if payload is not None:
            self._carrier._arrived(full[chunk:].numpy(), summed=op == dist.ReduceOp.SUM)
        return None


class ShardCarrier:
    """Carries the step's control on one FSDP unit's reduce-scatter; see the module docstring.

    Args:
        unit: the FSDP unit (:func:`carrying_unit`): its reduce-scatter comm is replaced until
            :meth:`close`.
        world_size: ranks in the group (2..:data:`~elastic_trainer.runtime.control_header.MAX_WORLD`).
    """

    def __init__(self, unit: nn.Module, *, world_size: int) -> None:
        control_header.check_world(world_size)
        self.world_size = world_size
        self._unit: nn.Module | None = unit
        self._previous = torch_compat.fsdp_reduce_scatter_comm(unit)
        self._payload: np.ndarray | None = None
        self._delivered = False
        self._result = np.zeros(_SLOTS, dtype=np.float64)
        self._missed = False
        unit.set_custom_reduce_scatter(_CarryingReduceScatter(self))  # type: ignore[operator]

    @classmethod
    def maybe(cls, model: nn.Module, env: DistEnv, *, enabled: bool = True) -> ShardCarrier | None:
        """A carrier for the sharded ``model`` in ``env`` (the attempt's), or ``None``: not
        where no carrier applies (:func:`~elastic_trainer.runtime.control_header.can_carry`), or
        without a unit that can carry (:func:`carrying_unit`). Alike on every rank of the attempt."""
        if not control_header.can_carry(env, enabled):
            return None
        unit = carrying_unit(model, env.world_size)
        return cls(unit, world_size=env.world_size) if unit is not None else None

    def close(self) -> None:
        """Give the unit its own reduce-scatter back (idempotent)."""
        unit, self._unit = self._unit, None
        if unit is not None:
            unit.set_custom_reduce_scatter(self._previous)  # type: ignore[operator]
        self._payload = None

    # -- the control channel's side ---------------------------------------------------------------
    def fits(self, buffer_values: int) -> bool:
        """Whether the next control can ride: no buffers, a unit to ride on, and no control
        missed its ride before (then every control goes on its own collective, on every rank)."""
        return buffer_values == 0 and self._unit is not None and not self._missed

    def board(self, control: np.ndarray, buffer_values: int) -> None:
        """Make the unit's next reduce-scatter carry this rank's control (``control[:4]``)."""
        if buffer_values:
            raise ValueError("a sharded model's control carries no buffers")
        payload = np.zeros(_SLOTS, dtype=np.float32)
        control_header.encode(payload, self.world_size, control)
        self._payload, self._delivered = payload, False

    def _take(self) -> np.ndarray | None:
        """(the reduce-scatter) The boarded payload, once."""
        payload, self._payload = self._payload, None
        return payload

    def _arrived(self, reduced: np.ndarray, *, summed: bool) -> None:
        """(the reduce-scatter) The control's reduction, every slot times ``w`` summed over the
        ranks, then divided by ``w``: by the reduction itself under ``AVG``, here when
        ``summed``. ``_result`` is then the plain sum of every rank's values."""
        np.divide(reduced, self.world_size if summed else 1, out=self._result)
        self._delivered = True

    def collect(self, control: np.ndarray, buffer_values: int) -> bool:
        """(after the backward) Write the reduced control into ``control`` (float64 numpy:
        ``[stop, loss, present, checkpoint failed]``) and return True; False when the payload
        did not travel on every rank (nothing stays aboard: send it on a collective of its own)."""
        delivered, self._delivered, self._payload = self._delivered, False, None
        if delivered and control_header.decode(self._result.tolist(), self.world_size, control):
            return True
        self._missed = True
        return False


__all__ = ["MAX_CARRY_NUMEL", "ShardCarrier", "carrying_unit"]
