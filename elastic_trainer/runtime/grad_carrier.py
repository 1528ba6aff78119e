"""The step's control carried by a gradient: DDP reduces it in its own C++ buckets.

    carrier = ControlCarrier.maybe(model, env)          # None where it does not apply
    ddp = DDP(carrier if carrier is not None else model)
    carrier.bind(ddp)                                   # then ControlChannel(env, carrier=carrier)

The wrapped model gains one small float32 parameter, ``control``. Every synchronised forward
(not under ``no_sync``, gradients on) passes the model's output through an identity autograd
function whose backward returns, as ``control``'s gradient, the payload that
:class:`~elastic_trainer.runtime.step_control.ControlChannel` boarded before the backward (the stop
flag, the loss, rank 0's buffers). DDP reduces that gradient with the model's gradients in the same
gloo allreduce, in C++, and after the backward the sum is read from ``control.grad``: no collective
of its own, no Python comm hook. Measured on the example CNN under the real launcher, a separate
control collective cost ~7 % of a step's CPU (``benchmarks/RESULTS.md``).

Encoding (exact whatever DDP's averaging does, for up to :data:`~elastic_trainer.runtime.control_header.MAX_WORLD` ranks): DDP divides
each gradient by the world size ``w`` and sums. Every slot is an integer times ``w`` (exact in
float32 below 2**24), so division and sum stay exact: flags are 0/1, rank 0's buffers travel as
the 8 bytes of each float64 value (one slot per byte; the other ranks send zeros), and a
``carried`` slot says that this rank's payload went into this backward. The loss travels as two
float32 halves (``hi``, ``lo``) times ``w``, as the float32 sum the bucket rider used to give.

Invariants: a synchronised backward always gives ``control`` a gradient (the payload or zeros),
so DDP never waits for it; ``control.grad`` is zeroed when a payload is boarded (through a numpy
view made once: no host read of a tensor per step), so nothing accumulates across steps or from a
backward the loop did not see (DDP priming passes, evaluation with gradients); a payload no backward delivered (the caller ran its own
backward before starting the control) is taken back and the control goes on its own collective,
on every rank alike, which the ``carried`` slot proves (its sum must be ``w``). Only on the CPU
with gloo as the default group: on CUDA reading the reduced gradient would make the host wait
for the device, which the control's own host collective avoids (``docs/design/steady-state.md``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from elastic_trainer.runtime import control_header, torch_compat
from elastic_trainer.runtime.distributed import DistEnv

_SLOTS = control_header.HEADER_SLOTS
_BYTES = 8
"""Slots per buffer value: the bytes of its float64."""


def buffer_values(model: nn.Module) -> int:
    """How many values the model's persistent buffers hold: the most a control can carry."""
    names = {name for name, _ in model.named_buffers()}
    return sum(t.numel() for key, t in model.state_dict().items() if key in names)


class _Carry(torch.autograd.Function):
    """A copy of the output (as DDP's own output sink makes: the caller may change it in place,
    which a view returned by a custom function forbids); its backward hands the boarded payload
    to ``control``."""

    @staticmethod
    def forward(
        ctx: Any, output: torch.Tensor, control: torch.Tensor, carrier: Any
    ) -> torch.Tensor:
        ctx.carrier = carrier
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, ctx.carrier._deliver(), None


@dataclass(slots=True)
class _Aboard:
    """The carrier's per-step state, kept off ``nn.Module.__setattr__`` (microseconds a write)."""

    control: torch.Tensor
    payload: torch.Tensor | None = None
    delivered: bool = False
    ddp: weakref.ref[Any] | None = None
    grad: torch.Tensor | None = None
    """``control.grad`` as last seen: DDP and autograd reduce into it in place from step to step."""
    grad_view: np.ndarray | None = None
    """Its numpy view (made once: no host read of a tensor per step)."""


class ControlCarrier(nn.Module):
    """The model, plus the ``control`` parameter whose gradient carries the step's control.

    Args:
        module: the user's model (``forward`` is its own; ``state_dict`` stays the model's:
            save ``module``, never this wrapper).
        world_size: ranks in the group (at most :data:`~elastic_trainer.runtime.control_header.MAX_WORLD`).
        buffer_values: the most buffer values a control carries (:func:`buffer_values`).
    """

    def __init__(self, module: nn.Module, *, world_size: int, buffer_values: int) -> None:
        super().__init__()
        control_header.check_world(world_size)
        self.module = module
        self.control = nn.Parameter(torch.zeros(_SLOTS + _BYTES * buffer_values))
        self._world = world_size
        self._size = self.control.numel()
        self._capacity = buffer_values
        self._aboard = _Aboard(self.control)

    @classmethod
    def maybe(
        cls, model: nn.Module, env: DistEnv, *, enabled: bool = True
    ) -> ControlCarrier | None:
        """A carrier for ``model`` in ``env`` (the attempt's: a heal changes the world size), or
        ``None``: where no carrier applies (:func:`~elastic_trainer.runtime.control_header.can_carry`)
        or without a float32 parameter (the control would get a bucket of its own). Alike on every rank of
        the attempt: it reads nothing but the job's settings, the attempt's world and the model."""
        if not control_header.can_carry(env, enabled):
            return None
        if not any(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters()):
            return None
        return cls(model, world_size=env.world_size, buffer_values=buffer_values(model))

    def __getattr__(self, name: str) -> Any:
        """The user's model's own attributes and methods through the carrier, so that code
        written for ``ddp.module`` (``generate``, ``config``, ...) runs alike with and without it
        (the carrier exists on the CPU only)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if name == "module" or "module" not in modules:
                raise
            return getattr(modules["module"], name)

    def bind(self, ddp: Any) -> None:
        """The DDP that wraps this carrier (its ``no_sync`` state decides which forwards carry)."""
        self._aboard.ddp = weakref.ref(ddp)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.module(*args, **kwargs)
        if not torch.is_grad_enabled() or not self._syncs():
            return output
        control, carrier = self.control, self
        return torch_compat.map_grad_tensors(output, lambda t: _Carry.apply(t, control, carrier))

    def _syncs(self) -> bool:
        ref = self._aboard.ddp
        ddp = ref() if ref is not None else None
        return ddp is None or bool(getattr(ddp, "require_backward_grad_sync", True))

    # -- the control channel's side ---------------------------------------------------------------
    def fits(self, buffer_values: int) -> bool:
        """Whether a control with this many buffer values fits the parameter."""
        return buffer_values <= self._capacity

    def board(self, control: np.ndarray, buffer_values: int) -> None:
        """Make the next synchronised backward carry this rank's control (see the module
        docstring for the encoding): ``control`` as :meth:`collect` writes it, of which
        ``buffer_values`` buffer values ride (rank 0's, on rank 0; the others send zeros)."""
        payload = np.zeros(self._size, dtype=np.float32)
        control_header.encode(payload, self._world, control)
        if buffer_values:
            raw = control[
                control_header.CONTROL_SLOTS : control_header.CONTROL_SLOTS + buffer_values
            ].view(np.uint8)  # a float64's 8 bytes, a slot each
            np.multiply(
                raw, float(self._world), out=payload[_SLOTS : _SLOTS + raw.size], casting="unsafe"
            )
        aboard = self._aboard
        # Nothing from a backward the loop did not see: the gradient this backward adds to is zero.
        if aboard.grad_view is not None and aboard.control.grad is aboard.grad:
            aboard.grad_view.fill(0.0)
        else:
            aboard.control.grad = None
        aboard.payload, aboard.delivered = torch.from_numpy(payload), False

    def _deliver(self) -> torch.Tensor:
        """(the backward) The boarded payload once, zeros otherwise: every synchronised backward
        gives ``control`` a gradient (an output used twice adds zeros to the payload)."""
        aboard = self._aboard
        payload, aboard.payload = aboard.payload, None
        if payload is None:
            return torch.zeros_like(aboard.control)
        aboard.delivered = True
        return payload

    def collect(self, control: np.ndarray, buffer_values: int) -> bool:
        """(after the backward) Write the reduced control into ``control`` (float64 numpy:
        ``[stop, loss, present, checkpoint failed, buffers...]``) and return True; False when
        the payload did not travel on every rank (then nothing aboard remains: send it on a
        collective of its own)."""
        aboard = self._aboard
        delivered, aboard.payload, aboard.delivered = aboard.delivered, None, False
        grad = aboard.control.grad
        if not delivered or grad is None:
            return False
        if grad is not aboard.grad or aboard.grad_view is None:
            aboard.grad, aboard.grad_view = grad, grad.detach().numpy()  # once, then reused
        summed = aboard.grad_view
        if not control_header.decode(summed[:_SLOTS].tolist(), self._world, control):
            return False
        if buffer_values:
            raw = summed[_SLOTS : _SLOTS + _BYTES * buffer_values].astype(np.uint8)  # exact
            control[control_header.CONTROL_SLOTS : control_header.CONTROL_SLOTS + buffer_values] = (
                raw.view(np.float64)
            )
        return True
