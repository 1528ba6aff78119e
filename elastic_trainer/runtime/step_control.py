"""The one small collective of every step: the stop flag, the global loss, and rank 0's buffers,
without the training thread ever waiting for the GPU.

Each step ``S`` starts an asynchronous allreduce of a host tensor
``[stop requested?, loss sum of step S-1, ranks that had it, checkpoint failed?]`` on a host-side
group (the default group when it is gloo; a gloo group of the same ranks under NCCL). Step S's
loss sum is copied device-to-host into a reused (pinned) slot behind an event, and read one step
later only if that copy is done (``Event.query``): a loss that is not ready is reported as
missing, never waited for. The values are read through numpy views of the host tensors, so no
``item``/``tolist``/``cpu`` runs on the training thread. Every rank reads the same reduced stop flag
after the same step: the step during which a signal arrived, or the next (when the read is
deferred to it, where waiting for the host collective costs nothing).

With just-in-time saving of a model whose buffers change in the forward (BatchNorm), rank 0's
buffers of step S must reach every rank before any rank applies S's update
(:mod:`elastic_trainer.checkpoint.jit`). On the CPU they ride on the same host tensor and the update
waits for it. On CUDA they ride on a device allreduce and the host waits for it before queueing the
update: the one wait on the GPU left in a step, only for such models (``docs/design/steady-state.md``).

On the CPU with ``Elastic``/``Trainer`` (gloo, a :class:`ControlCarrier` around the model) the
control travels as the gradient of the carrier's parameter: DDP reduces it in C++ with the model's
gradients and it is read after the backward (:mod:`elastic_trainer.runtime.grad_carrier`); a
control the backward did not carry goes on its own collective. Otherwise (CUDA, a loop with its
own DDP) the control is this collective of its own, started before the backward (it overlaps it).
No Python comm hook is involved either way: DDP's buckets stay in C++ (issue 30). Every rank
carries or none does (agreed when the channel is built). A sharded (FSDP2) model has no DDP: there
the control rides on one unit's reduce-scatter (:mod:`elastic_trainer.runtime.shard_carrier`),
read after the backward as well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from elastic_trainer.runtime.abortable import AbortableWaits
from elastic_trainer.runtime.control_header import CONTROL_SLOTS
from elastic_trainer.runtime.distributed import DistEnv

_STOP, _LOSS, _PRESENT, _CHECKPOINT_FAILED, _CHECKED = 0, 1, 2, 3, 4
_HEADER = CONTROL_SLOTS


class Carrier(Protocol):
    """What carries a control inside the backward's own collectives: DDP's gradient
    (:class:`~elastic_trainer.runtime.grad_carrier.ControlCarrier`) or an FSDP2 unit's
    reduce-scatter (:class:`~elastic_trainer.runtime.shard_carrier.ShardCarrier`)."""

    def fits(self, buffer_values: int) -> bool:
        """Whether a control with this many buffer values can ride now."""
        ...

    def board(self, control: np.ndarray, buffer_values: int) -> None:
        """Make the next synchronised backward carry this rank's control (laid out as
        :meth:`collect` writes it), with its first ``buffer_values`` buffer values (rank 0's)."""
        ...

    def collect(self, control: np.ndarray, buffer_values: int) -> bool:
        """(after the backward) The reduced control into ``control``; False when it did not
        travel on every rank (it then goes on a collective of its own)."""
        ...


@dataclass(slots=True)
class PendingControl:
    """A step's control allreduce, maybe still in flight."""

    step: int
    host: torch.Tensor
    view: Any
    """numpy view of ``host``: read without a torch call."""
    work: Any
    loss_of: int | None
    """The step whose loss sum rides on this control (the previous one), if any."""
    loss_samples: int
    """That step's global sample count."""
    buffers: torch.Tensor | None = None
    """Rank 0's buffers of this step (after :meth:`ControlChannel.wait_before_update`)."""
    buffer_work: Any = None
    complete: bool = False
    """The update waited for it: its stop flag can be read without waiting."""
    carried: bool = False
    """Aboard the model's gradient (:mod:`elastic_trainer.runtime.grad_carrier`), not read yet."""
    checksum_of: int | None = None
    """The step after which this rank's parameter checksum rides on this control, if any."""


@dataclass(frozen=True, slots=True)
class ControlResult:
    """A finished control: whether every rank must stop, and the loss of the step it carried."""

    step: int
    stop: bool
    loss_step: int | None
    loss: float | None
    """Mean loss over that step's global batch; ``None`` if a rank's value was not ready."""
    checkpoint_failed: bool
    check_sums: tuple[int, ...] | None = None
    """The :data:`~elastic_trainer.runtime.control_header.CHECK_BITS` check slots summed over the ranks, when every rank sent its
    parameters' check after step :attr:`checksum_of` on this control (read by
    :class:`~elastic_trainer.train.replica_check.ReplicaCheck`); ``None``: not compared."""
    checksum_of: int | None = None


class ControlChannel:
    """Starts and finishes the per-step control of one worker (see the module docstring).

    Args:
        env: this worker's place in the job (its process group must exist; every rank constructs
            its channel at the same point: under NCCL that creates a gloo group).
        waits: where the control's waits go (the healer's abortable waits when healing in place).
        carrier: the model's :class:`Carrier` (DDP's gradient, or an FSDP unit's
            reduce-scatter): the control rides on it when started before the synchronised backward.
    """

    def __init__(
        self,
        env: DistEnv,
        *,
        waits: AbortableWaits | None = None,
        carrier: Carrier | None = None,
    ) -> None:
        self.env = env
        self._waits = waits if waits is not None else AbortableWaits()
        self._cuda = env.device.type == "cuda"
        self.group: Any = None
        if env.world_size > 1 and env.backend != "gloo":
            self.group = dist.new_group(backend="gloo")  # host-side: a CPU tensor, no device stream
        # Carrying needs the gradients on the CPU and on the group the control would use (the
        # default), and every rank carrying: their buckets' collectives must match.
        possible = (
            env.world_size > 1 and self.group is None and not self._cuda
        )  # alike on every rank
        self._carrier = carrier if possible and _everyone(carrier is not None) else None
        self._size_hosts(_HEADER)
        self._loss_slots = [
            torch.zeros((), dtype=torch.float64, pin_memory=self._cuda) for _ in range(2)
        ]
        self._loss_views = [s.numpy() for s in self._loss_slots]
        self._loss_events: list[Any] = [
            torch.cuda.Event() if self._cuda else None for _ in range(2)
        ]
        self._loss_step: int | None = None
        self._loss_samples = 0
        self._turn = 0

    def _size_hosts(self, size: int) -> None:
        self._hosts = [torch.zeros(size, dtype=torch.float64) for _ in range(2)]
        self._views = [h.numpy() for h in self._hosts]

    def start(
        self,
        step: int,
        loss_sum: torch.Tensor | None,
        *,
        global_samples: int,
        stop: bool,
        buffers: torch.Tensor | None = None,
        checkpoint_failed: bool = False,
        checksum: tuple[int, Sequence[float]] | None = None,
    ) -> PendingControl:
        """Start step ``step``'s control: this rank's stop flag, the previous step's loss sum, and
        ``buffers`` (this rank's contribution of rank 0's buffers, or ``None``). ``loss_sum`` (this
        rank's loss summed over its samples of ``step``) is staged for the next control.
        ``checksum``: ``(step, slots)``, this rank's :data:`~elastic_trainer.runtime.control_header.CHECK_BITS` check slots of its
        parameters after that step, summed across the ranks (every rank passes one on the same
        control)."""
        if (
            buffers is not None
            and not self._cuda
            and self._hosts[0].numel() != _HEADER + buffers.numel()
        ):
            self._size_hosts(
                _HEADER + buffers.numel()
            )  # the first step with buffers, or a new layout
        turn = self._turn
        self._turn ^= 1
        host, view = self._hosts[turn], self._views[turn]
        view[_STOP] = 1.0 if stop else 0.0
        view[_CHECKPOINT_FAILED] = 1.0 if checkpoint_failed else 0.0
        view[_CHECKED] = 0.0 if checksum is None else 1.0
        view[_CHECKED + 1 : _HEADER] = 0.0 if checksum is None else checksum[1]
        previous, view[_LOSS], view[_PRESENT] = self._loss_step, 0.0, 0.0
        if previous is not None:
            slot = turn ^ 1  # staged by the previous start
            event = self._loss_events[slot]
            if event is None or event.query():
                view[_LOSS], view[_PRESENT] = float(self._loss_views[slot]), 1.0
        pending = PendingControl(
            step=step,
            host=host,
            view=view,
            work=None,
            loss_of=previous,
            loss_samples=self._loss_samples,
            checksum_of=None if checksum is None else checksum[0],
        )
        self._send(pending, buffers)
        # Stage this step's loss for the next control (into the slot this one did not read).
        if loss_sum is not None:
            self._loss_slots[turn].copy_(loss_sum.detach().reshape(()), non_blocking=self._cuda)
            event = self._loss_events[turn]
            if event is not None:
                event.record()
            self._loss_step, self._loss_samples = step, global_samples
        else:
            self._loss_step = None
        return pending

    def _send(self, pending: PendingControl, buffers: torch.Tensor | None) -> None:
        """Start ``pending`` on its way: aboard the carrier, else on its own host collective;
        ``buffers`` with it on the CPU, on a device allreduce of their own on CUDA."""
        if buffers is not None and not self._cuda:
            pending.host[_HEADER:].copy_(buffers)
            pending.buffers = pending.host[_HEADER:]
        size = pending.buffers.numel() if pending.buffers is not None else 0
        carrier = self._carrier
        if carrier is not None and carrier.fits(size):
            carrier.board(pending.view, size if self.env.rank == 0 else 0)
            pending.carried = True
        elif self.env.world_size > 1:
            pending.work = self._allreduce(pending.host)
        if buffers is not None and self._cuda:
            pending.buffers = buffers.clone()
            pending.buffer_work = (
                dist.all_reduce(pending.buffers, async_op=True) if self.env.world_size > 1 else None
            )

    def _allreduce(self, host: torch.Tensor) -> Any:
        work = dist.all_reduce(host, group=self.group, async_op=True)
        # Healing in place, wait on a future an abort can end (see runtime/abortable.py).
        waits = self._waits
        return waits.track(work.get_future()) if waits.enabled else work  # type: ignore[union-attr]

    def _land(self, pending: PendingControl) -> None:
        """A carried control, after the backward: its sum, into ``pending.host`` (float64)."""
        pending.carried = False
        size = pending.buffers.numel() if pending.buffers is not None else 0
        if self._carrier is None or not self._carrier.collect(pending.view, size):
            # No synchronised backward took it (every rank alike): its own collective.
            self._allreduce(pending.host).wait()
        pending.complete = True

    def wait_before_update(self, pending: PendingControl) -> None:
        """Rank 0's buffers ride on ``pending``: no rank updates before they arrived (raises if a
        peer died, leaving the state "after the previous step"). A control carried by the
        gradient is complete after the backward: it is read now."""
        if pending.carried:
            self._land(pending)
            return
        if pending.buffers is None:
            return
        if self._cuda:
            if pending.buffer_work is not None:
                pending.buffer_work.wait()
                pending.buffer_work = None
                # NCCL's wait() only orders streams. A buffer allreduce that never completes (dead
                # peer) must leave the update unqueued, or the host would record "step S+1" while
                # the GPU stays at S: the one host wait on the GPU, for models with buffers only.
                torch.cuda.current_stream(self.env.device).synchronize()
        else:
            if pending.work is not None:
                pending.work.wait()
                pending.work = None
        pending.complete = True

    def finish(self, pending: PendingControl) -> ControlResult:
        """Wait for ``pending``'s host collective if needed (it ran while the host computed) and read it."""
        if pending.carried:
            self._land(pending)
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
        view = pending.view
        loss = None
        if (
            pending.loss_of is not None
            and view[_PRESENT] == self.env.world_size
            and pending.loss_samples
        ):
            loss = float(view[_LOSS]) / pending.loss_samples
        w = self.env.world_size
        compared = pending.checksum_of is not None and round(view[_CHECKED]) == w
        return ControlResult(
            step=pending.step,
            stop=bool(view[_STOP] > 0),
            loss_step=pending.loss_of,
            loss=None if loss is not None and math.isnan(loss) else loss,
            checkpoint_failed=bool(view[_CHECKPOINT_FAILED] > 0),
            check_sums=tuple(round(v) for v in view[_CHECKED + 1 : _HEADER]) if compared else None,
            checksum_of=pending.checksum_of,
        )


def _everyone(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank of the default group (one collective; construction only)."""
    votes = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(votes, op=dist.ReduceOp.MIN)
    return bool(votes.numpy()[0] > 0)
