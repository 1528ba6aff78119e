"""Training state from a live peer: the checkpoint payload in three broadcasts, instead of a disk read.

The source rank splits the payload a checkpoint holds (model, optimizers, scheduler, scaler,
sampler, step, RNG) into its tensors and the rest. The rest -- containers (``OrderedDict`` and a
state dict's ``_metadata`` kept) and scalars, each tensor replaced by its index, plus every
tensor's dtype, shape and place -- is serialised with ``torch.save`` (a few kB; its size goes
first) and every rank loads it with ``weights_only=True``, as it would load the checkpoint file.
The tensors travel as their raw bytes, packed into one flat buffer, in one broadcast over a
host-side (gloo) group; each rank copies its tensors out of that buffer onto its own ``device``
(own storage each: a view would keep, and a later ``torch.save`` would write, the whole buffer).
Each broadcast is waited on through ``runtime/abortable.py``, so a round that opens meanwhile
ends it. Serialising the tensors too (``torch.save`` into memory and back) cost ten
times the broadcast itself: 4.3 s against 0.3 s for 600 MB (``benchmarks/restart_cost.py``).
Every member takes the state, the source included: a survivor's module buffers may have moved in
the forward of the step that failed, and the payload carries those of the last completed step.

A replicated (DDP) heal is one transfer, logged at INFO on every rank. A sharded heal is several
(a layout, then one per moved shard: ``heal/sharded_restore.py``, ``heal/shard_move.py``): each
at DEBUG, counted in a :class:`TransferTally`, and rank 0 says once what moved.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.runtime.abortable import AbortableWaits
from elastic_trainer.state import flat as flat_payload

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferTally:
    """The shards one sharded heal moved: how many, and their bytes (every member of the group
    takes part in each broadcast, so every rank counts the same)."""

    shards: int = 0
    """Shard transfers so far."""
    nbytes: int = 0
    """Their payloads' bytes (tensors and the serialised rest)."""

    def describe(self) -> str:
        """One phrase for the heal's log line."""
        return f"moved {self.shards} shard(s), {self.nbytes / 1e6:.1f} MB"


def _broadcast(tensor: torch.Tensor, *, src: int, group: Any, waits: AbortableWaits) -> None:
    """One broadcast, waited on so that an abort ends it (``runtime/abortable.py``)."""
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    if work is not None:
        waits.track(work.get_future()).wait()


def _broadcast_bytes(data: bytes | None, *, src: int, group: Any, waits: AbortableWaits) -> bytes:
    size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
    _broadcast(size, src=src, group=group, waits=waits)
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(int(size[0]), dtype=torch.uint8)
    )
    _broadcast(buffer, src=src, group=group, waits=waits)
    return buffer.numpy().tobytes()


def share_state(
    payload: dict[str, Any] | None,
    *,
    src: int,
    device: torch.device,
    group: Any = None,
    waits: AbortableWaits | None = None,
    level: int = logging.INFO,
    tally: TransferTally | None = None,
) -> dict[str, Any]:
    """Collective: rank ``src`` passes ``payload`` (host tensors), every rank returns a copy on
    ``device``; its broadcasts are waited on through ``waits`` (the healer's: an abort ends them).
    The transfer is logged at ``level`` (a sharded heal's several: DEBUG) and, with ``tally``,
    counted there as one shard moved.

    Raises:
        RuntimeError: a peer failed during the transfer (the caller heals again), or what arrived
            is not a checkpoint payload.
    """
    started = time.monotonic()
    waits = waits if waits is not None else AbortableWaits()
    rank = dist.get_rank()
    packed = None
    if rank == src:
        if payload is None:
            raise ValueError("the source rank has no state to share")
        packed = flat_payload.pack(payload)
    meta = flat_payload.read_header(
        _broadcast_bytes(packed.header if packed else None, src=src, group=group, waits=waits)
    )
    flat = torch.empty(int(meta["total"]), dtype=torch.uint8)
    if packed is not None:
        flat_payload.fill(packed, flat)
    if flat.numel():
        _broadcast(flat, src=src, group=group, waits=waits)
    state = flat_payload.unpack(meta, flat, device)
    if not isinstance(state, dict):
        raise RuntimeError("the shared state is not a checkpoint payload")
    nbytes = int(meta["total"])
    if tally is not None:
        tally.shards += 1
        tally.nbytes += nbytes
    log.log(
        level,
        "heal: state of step %s from rank %d: %.1f MB in %.3f s",
        state.get("step"),
        src,
        nbytes / 1e6,
        time.monotonic() - started,
    )
    return state
