"""The step's control, carried by the first gradient bucket's allreduce instead of a collective of
its own (gloo, CPU tensors, an opt-in comm hook of this package: ``runtime/comms.py``).

Not used at the defaults, nor under the metrics' opt-in ``hook`` timing (registered without the
worker's comms): a Python comm hook on every bucket costs more than the collective it saves, and
on the CPU the control now travels as a gradient DDP reduces anyway
(:mod:`elastic_trainer.runtime.grad_carrier`, issue 30, ``docs/design/steady-state.md``). Reached
only by a loop that registers :func:`~elastic_trainer.runtime.comms.abortable_allreduce_hook` with
its group's ``WorkerComms`` itself, on a DDP without a carrier; a candidate for removal.

A separate gloo collective per step costs its enqueue, gloo's thread and the wake-ups: on the
example CNN's 6 ms CPU step about a tenth of the runtime's CPU (``benchmarks/RESULTS.md``).
:class:`~elastic_trainer.runtime.step_control.ControlChannel` boards a float32 payload before the
backward; the first bucket hook that runs reduces ``[bucket, payload]`` as one coalesced gloo
allreduce (gloo flattens them into one buffer in C++), and the payload completes with the bucket.

Invariants: at most one payload aboard; a payload no hook took is taken back by its owner within
the same step (then it travels on its own collective, as without a rider), so a later backward
never carries a stale one; every rank runs the same hooks at the same steps, so the collectives
match across ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class BucketRider:
    """The payload waiting for the next bucket, and the future of the one a bucket took."""

    def __init__(self) -> None:
        self._aboard: torch.Tensor | None = None
        self._taken: tuple[torch.Tensor, torch.futures.Future[Any]] | None = None
        self._options = dist.AllreduceCoalescedOptions()  # a sum, as the CPU buckets' allreduce

    def board(self, payload: torch.Tensor) -> None:
        """Carry ``payload`` (float32, CPU; summed over the ranks in place) on the next bucket."""
        if self._aboard is not None:
            raise RuntimeError("a control payload is already aboard")
        self._aboard, self._taken = payload, None

    def clear(self) -> None:
        """Forget any payload (a new group: one left by a failed step must not ride on its buckets)."""
        self._aboard, self._taken = None, None

    def allreduce(
        self, group: Any, buffer: torch.Tensor, options: Any = None
    ) -> torch.futures.Future[Any]:
        """(comm hook) Start ``buffer``'s sum over ``group``, with the payload aboard if any: one
        collective either way. The future's value is a list whose first tensor is ``buffer``."""
        payload, world = self._aboard, dist.group.WORLD
        group = world if group is None else group
        if (
            payload is None
            or buffer.device.type != "cpu"
            or buffer.dtype != payload.dtype
            or group is not world
            or world is None
        ):  # the control's group only
            if options is None:
                return dist.all_reduce(buffer, group=group, async_op=True).get_future()  # type: ignore[union-attr]
            return group.allreduce([buffer], options).get_future()  # type: ignore[no-any-return]
        self._aboard = None
        future = world.allreduce_coalesced([buffer, payload], self._options).get_future()
        self._taken = (payload, future)
        return future  # type: ignore[no-any-return]

    def collect(self, payload: torch.Tensor) -> torch.futures.Future[Any] | None:
        """(the payload's owner, after the backward) The future that carries ``payload``, or
        ``None`` when no bucket took it (it is taken back: nothing stays aboard)."""
        if self._aboard is payload:
            self._aboard = None
            return None
        taken, self._taken = self._taken, None
        if taken is None or taken[0] is not payload:
            return None
        return taken[1]
