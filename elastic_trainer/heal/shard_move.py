"""Moving the shards of a lost world onto a new world size at a heal, in memory (collective).

    payload, refused = reshard_shards(holder, plan, rank=rank, group=group, waits=waits)

``plan`` is :func:`heal.sharded_restore.plan_reshard`'s: where every old shard of its step
survived (a survivor's live state or staged copy, a neighbour copy). The holder of old shard 0
sends the layout (every shard entry's global shape and placement: ``local_shards.LAYOUT``, a few
kB); every rank then knows which old shards each new rank needs (``state/reshard.py``). Each old
shard that some rank other than its holder needs is broadcast once from its holder on the heal's
host group (``share_state``: abortable); each rank keeps only the rows of its new chunk and drops
the rest, so no rank holds more than its new shard and the old shard in hand. An old shard only
its holder needs does not travel. ``refused`` is the one-line reason when the layout cannot be
resharded (another placement than FSDP2's dim 0 of a 1-D mesh): every rank sees the same layout,
so every rank falls back to the checkpoint together. Design: ``docs/design/sharded.md``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from elastic_trainer.heal.state_transfer import TransferTally, share_state
from elastic_trainer.runtime.abortable import AbortableWaits
from elastic_trainer.state.local_shards import LAYOUT
from elastic_trainer.state.reshard import Resharder, unsupported
from elastic_trainer.state.restore_plan import RestorePlan, ShardHolder

log = logging.getLogger(__name__)


def reshard_shards(
    holder: ShardHolder | None,
    plan: RestorePlan,
    *,
    rank: int,
    group: Any = None,
    waits: AbortableWaits | None = None,
    tally: TransferTally | None = None,
) -> tuple[dict[str, Any] | None, str | None]:
    """Collective: this rank's payload at ``plan.new_world`` ranks, cut from the old shards
    (``(payload, None)``), or ``(None, reason)`` when the shards cannot be resharded in place.
    Each old shard sent is counted in ``tally`` (the layout is not a shard); every transfer is
    logged at DEBUG only (the caller's rank 0 says once what moved).

    Raises:
        RuntimeError: a peer failed during a transfer (the caller heals again).
        LookupError: a source no longer holds what the plan names (stale holdings).
    """
    if plan.step is None or not plan.old_world:
        raise ValueError("not a reshard plan")
    started = time.monotonic()
    step, cpu = plan.step, torch.device("cpu")

    def payload_of(shard: int) -> dict[str, Any]:
        if holder is None:
            raise LookupError(f"rank {rank} holds no shards, and the plan names it")
        return holder.payload(plan.sources[shard].what, shard=shard, step=step)

    first = payload_of(0) if plan.sources[0].rank == rank else None  # read once: layout and move

    def held_here(shard: int) -> dict[str, Any]:
        return first if shard == 0 and first is not None else payload_of(shard)

    layout = _shared_layout(first, plan, group=group, waits=waits)
    refused = unsupported(layout)
    if refused is not None:
        return None, f"the shards cannot be resharded in place ({refused})"
    cuts = _cuts(layout, plan)
    mine = cuts[rank]
    sent = 0
    for shard, source in enumerate(plan.sources):
        needers = {new for new, cut in enumerate(cuts) if shard in cut.needed()}
        if not needers or needers == {source.rank}:
            if rank == source.rank and rank in needers:
                mine.take(shard, held_here(shard))
            first = None
            continue
        own = held_here(shard) if rank == source.rank else None
        got = share_state(
            own,
            src=source.rank,
            device=cpu,
            group=group,
            waits=waits,
            level=logging.DEBUG,
            tally=tally,
        )
        sent += 1
        if rank in needers:
            mine.take(shard, own if own is not None else got)
        del got, own  # the rows kept are copies: the old shard is dropped here
        first = None
    payload = mine.result()
    log.debug(
        "heal: resharded step %d from %d to %d ranks: %d old shard(s) sent, %.2f s",
        step,
        plan.old_world,
        plan.new_world,
        sent,
        time.monotonic() - started,
    )
    return payload, None


def _shared_layout(
    first: dict[str, Any] | None, plan: RestorePlan, *, group: Any, waits: AbortableWaits | None
) -> Any:
    """Collective: the shards' layout, from the holder of shard 0 (``first``: what it holds)."""
    return share_state(
        None if first is None else {"step": plan.step, LAYOUT: first.get(LAYOUT)},
        src=plan.sources[0].rank,
        device=torch.device("cpu"),
        group=group,
        waits=waits,
        level=logging.DEBUG,
    )[LAYOUT]


def _cuts(layout: Any, plan: RestorePlan) -> list[Resharder]:
    """Every new rank's cut of the old shards. Over shards, not ranks: HSDP's replicas of a shard
    hold the same rows (new rank j holds new shard j % new_shards; FSDP: every rank its own)."""
    return [
        Resharder(
            layout, old_world=plan.old_shards, new_world=plan.new_shards, rank=new % plan.new_shards
        )
        for new in range(plan.new_world)
    ]
