"""The explicit context of one worker's runtime collectives: its abortable waits and its bucket rider.

    comms = WorkerComms(waits=healer.waits)             # ElasticGroup builds one per worker run
    channel = ControlChannel(env, waits=comms.waits, rider=comms.rider if rides(ddp, comms) else None)

Before issue 30 these were two process-wide singletons (``WAITS``, ``RIDER``) that seven modules
flipped or read; now whoever needs them is handed this object (the healer owns the waits, the
:class:`~elastic_trainer.train.elastic_group.ElasticGroup` the rider), so a test or a second group
in one process cannot see another's state.

At the defaults nothing here touches DDP's buckets: DDP reduces them in C++ (no comm hook), the
step's control travels on its own small host collective (or, opt-in on the CPU, as a gradient in
them: ``runtime/grad_carrier.py``), and a bucket wait that gloo leaves blocked after an abort is
ended by the healer's stop watch (``docs/design/heal-in-place.md``). Nothing in the package
registers the hooks below by itself; a loop registers them explicitly. The hooks
below are opt-in: :func:`abortable_allreduce_hook` (every bucket's wait tracked, the control
riding on the first bucket) for a job that prefers an abort to reach its bucket waits over the
~13-21 % that a Python hook on every bucket costs on a CPU MLP (``benchmarks/RESULTS.md``), and
``AllreduceTimer(comms=...)`` for the metrics' timing hook (which the observer's ``hook`` mode
registers without: plain futures, nothing rides).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.runtime import torch_compat
from elastic_trainer.runtime.abortable import AbortableWaits
from elastic_trainer.runtime.bucket_rider import BucketRider


@dataclass(slots=True)
class WorkerComms:
    """What the runtime's waits on one worker's collectives share (see the module docstring)."""

    waits: AbortableWaits = field(default_factory=AbortableWaits)
    """Waits an abort can end (enabled by the healer on gloo/CPU; plain otherwise)."""
    rider: BucketRider = field(default_factory=BucketRider)
    """The step's control waiting to ride on a bucket (only under a hook that offers its buckets)."""


def rides(ddp_model: Any, comms: WorkerComms) -> bool:
    """Whether ``ddp_model``'s buckets are reduced by a hook of ``comms`` that takes the control
    aboard: the hook's state is ``comms`` or holds it as ``.comms``."""
    for state in torch_compat.comm_hook_states(ddp_model):
        if state is comms or getattr(state, "comms", None) is comms:
            return True
    return False


def _bucket_value(done: torch.futures.Future[Any]) -> torch.Tensor:
    return done.value()[0]  # type: ignore[no-any-return]


def abortable_allreduce_hook(
    state: WorkerComms, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """(Opt-in) DDP comm hook: torch's default allreduce (an average over the default group) with
    its future tracked by ``state.waits`` and the step's control riding on it. Register with
    ``ddp.register_comm_hook(comms, abortable_allreduce_hook)``; costs a Python call, a division
    and a copy of every bucket, which the defaults avoid."""
    group = dist.group.WORLD
    buffer = bucket.buffer()
    world = dist.get_world_size(group)
    if world > 1:
        buffer.div_(world)
    future = state.rider.allreduce(
        group, buffer
    )  # the step's control may ride on it (runtime/bucket_rider.py)
    return state.waits.track(future, _bucket_value)


# DDP compares a hook's annotations with the real types; this module's are strings (PEP 563).
abortable_allreduce_hook.__annotations__ = {
    "state": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
