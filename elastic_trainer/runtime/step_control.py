"""The one small collective of every step: the global loss, the stop flag, and rank 0's buffers.

Every rank contributes ``[loss sum of its samples, stop requested?]`` (and, with just-in-time saving
of a model with buffers, rank 0's buffers: :class:`~elastic_trainer.checkpoint.jit.AuthoritativeBuffers`)
to one allreduce per step, started after the step's last forward so that it overlaps the backward.
Every rank reads the same reduced stop flag after the same step, so all stop together: after the
step during which a signal arrived, or one step later (the read is deferred to the next step, when
waiting for the allreduce costs nothing). When buffers ride on it, the update waits for it
(:meth:`ControlChannel.wait_before_update`) and it is read at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.runtime.distributed import DistEnv


@dataclass(slots=True)
class PendingControl:
    """A step's control allreduce, maybe still in flight."""

    step: int
    global_samples: int
    control: torch.Tensor
    work: Any
    buffers_at: int | None = None
    """Where rank 0's module buffers start in ``control``, if they ride on it."""
    complete: bool = False
    """The update waited for it: its loss and stop flag can be read without waiting."""

    @property
    def buffers(self) -> torch.Tensor | None:
        """Rank 0's buffers of this step as they arrived (complete controls only)."""
        return None if self.buffers_at is None else self.control[self.buffers_at:]


@dataclass(frozen=True, slots=True)
class ControlResult:
    """A finished step's control: the global mean loss and whether every rank must stop."""

    step: int
    loss: float
    stop: bool


class ControlChannel:
    """Starts and finishes the per-step control allreduce of one worker (see the module docstring)."""

    def __init__(self, env: DistEnv) -> None:
        self.env = env

    def start(self, step: int, loss_sum: torch.Tensor, *, global_samples: int, stop: bool,
              buffers: torch.Tensor | None = None) -> PendingControl:
        """Start step ``step``'s allreduce of ``loss_sum`` (this rank's samples' loss, summed), the
        stop flag and ``buffers`` (this rank's contribution of rank 0's buffers, or ``None``)."""
        device = self.env.device
        flag = torch.tensor(float(stop), device=device)
        if buffers is None:
            control = torch.stack([loss_sum.detach().float().reshape(()), flag])
        else:
            control = torch.cat([torch.stack([loss_sum.detach().double().reshape(()), flag.double()]),
                                 buffers.to(device)])
        work = dist.all_reduce(control, async_op=True) if self.env.world_size > 1 else None
        return PendingControl(step=step, global_samples=global_samples, control=control, work=work,
                              buffers_at=None if buffers is None else 2)

    def wait_before_update(self, pending: PendingControl) -> None:
        """Rank 0's buffers ride on ``pending``: no rank updates before it completed (raises if a
        peer died, leaving the state "after the previous step")."""
        if pending.buffers_at is None:
            return
        if pending.work is None:  # one rank: nothing to wait for
            pending.complete = True
            return
        pending.work.wait()
        pending.work = None
        if pending.control.device.type == "cuda":
            # NCCL's wait() only orders streams. Block the host as well: a control allreduce that
            # never completes (dead peer) must leave the update unqueued, or the host would record
            # "step S+1" while the GPU stays at S (and a just-in-time snapshot, which waits for the
            # last update's event, would wait forever).
            torch.cuda.current_stream(pending.control.device).synchronize()
        pending.complete = True

    def finish(self, pending: PendingControl) -> ControlResult:
        """Wait for ``pending`` if needed and read it."""
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
        loss_sum, stop = pending.control[:2].tolist()
        return ControlResult(step=pending.step, loss=loss_sum / pending.global_samples, stop=stop > 0)
