"""The step control's header as it rides inside a backward's own collective.

Both carriers (DDP's gradient, :mod:`~elastic_trainer.runtime.grad_carrier`; an FSDP2 unit's
reduce-scatter, :mod:`~elastic_trainer.runtime.shard_carrier`) send the same :data:`HEADER_SLOTS`
float32 slots and read them back the same way. Invariants: every slot is an integer times the
world size ``w`` (exact in float32 below 2**24), so the reduction's averaging (the sum divided by
``w``) leaves the plain sum over the ranks, exactly; the ``carried`` slot sums to ``w`` only when
every rank's payload travelled; the loss travels as two float32 halves, as a float32 sum would
give it; a loss that is nan, infinite or beyond float32 is reported as missing (nan).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from elastic_trainer.runtime.distributed import DistEnv

CARRIED, STOP, PRESENT, CHECKPOINT_FAILED, LOSS_HI, LOSS_LO, CHECKED = range(7)
CHECK_BITS = 16
"""Bits of the replicas' parameter checksum a control carries, one slot each: summed over the
ranks a bit is 0 or ``w`` on every slot exactly when every rank sent the same checksum."""
HEADER_SLOTS = CHECKED + 1 + CHECK_BITS
CONTROL_SLOTS = 5 + CHECK_BITS
"""The float64 control's header: ``[stop, loss, present, checkpoint failed, checked, bits...]``
(buffers follow it)."""
_LOSS_LIMIT = 1e38
MAX_WORLD = 256
"""Up to this many ranks every slot stays an exact float32 integer (255 x w x w < 2**24)."""


def can_carry(env: DistEnv, enabled: bool) -> bool:
    """Whether a carrier may apply in ``env`` at all: ``enabled``
    (``ELASTIC_TRAINER_CONTROL_CARRIER``), 2..:data:`MAX_WORLD` ranks, the CPU, gloo."""
    return (
        enabled
        and 1 < env.world_size <= MAX_WORLD
        and env.device.type == "cpu"
        and env.backend == "gloo"
    )


def check_world(world_size: int) -> None:
    """A carrier's constructor check: ``ValueError`` outside 2..:data:`MAX_WORLD` ranks."""
    if not 1 < world_size <= MAX_WORLD:
        raise ValueError(f"world_size {world_size}: a carrier needs 2..{MAX_WORLD} ranks")


def encode(payload: np.ndarray, world_size: int, control: np.ndarray) -> None:
    """Write this rank's header (``control[:CONTROL_SLOTS]``: ``[stop, loss, present, checkpoint
    failed, checked, checksum bits...]``,
    the layout :func:`decode` writes back), each value times ``world_size``, into
    ``payload[:HEADER_SLOTS]``."""
    w = float(world_size)
    stop, loss, present, checkpoint_failed = control[0], control[1], control[2], control[3]
    if not abs(loss) < _LOSS_LIMIT:  # nan, inf or beyond float32: reported as missing
        loss = math.nan
    hi = float(np.float32(loss))
    payload[CARRIED], payload[STOP], payload[PRESENT] = w, stop * w, present * w
    payload[CHECKPOINT_FAILED], payload[LOSS_HI] = checkpoint_failed * w, hi * w
    payload[LOSS_LO] = (loss - hi) * w
    payload[CHECKED : CHECKED + 1 + CHECK_BITS] = control[4:CONTROL_SLOTS] * w


def decode(reduced: Sequence[float], world_size: int, control: np.ndarray) -> bool:
    """Write the reduced header (the plain sum over the ranks: ``reduced[:HEADER_SLOTS]``) into
    ``control[:CONTROL_SLOTS]`` as :func:`encode` reads it and return True; False, and
    nothing written, when not every rank's payload travelled."""
    carried, stop, present, failed, hi, lo = reduced[:CHECKED]
    if round(carried) != world_size:
        return False
    control[0], control[1], control[2], control[3] = (
        round(stop),
        hi + lo,
        round(present),
        round(failed),
    )
    control[4:CONTROL_SLOTS] = [round(v) for v in reduced[CHECKED : CHECKED + 1 + CHECK_BITS]]
    return True


__all__ = [
    "CHECK_BITS",
    "CONTROL_SLOTS",
    "HEADER_SLOTS",
    "MAX_WORLD",
    "can_carry",
    "check_world",
    "decode",
    "encode",
]
