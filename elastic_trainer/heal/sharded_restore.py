"""Healing sharded (FSDP2 / HSDP) state in place: every shard of one step, from where it survived.

A replicated (DDP) state heals from any one member; a sharded one needs each rank's own shard.
After the new epoch's group formed, every member says what it holds (``Holdings``: its live step,
its own staged shards, the neighbour copies it received; a replacement holds nothing), and
:func:`plan_restore` picks the newest step at which every shard exists somewhere:

* a survivor's own shard: its live state, or its own staged copy (to go back a step or more);
* a lost rank's shard: its neighbour copy on its holder (FSDP ring), or a replica's live state
  or staged copy (HSDP);
* none: both copies are gone (two neighbours lost together, the copy off; an HSDP mesh whose
  world size changed):
  the job falls back to the newest checkpoint, resharded, and counts the steps it redoes.

:func:`restore_shards` runs the plan: each shard that is not already where it belongs is sent
from its holder (one broadcast each, on the heal's host group, waited on abortably). When the
world size changed (elastic: a node lost for good, or one joining) or survivors were renumbered,
:func:`plan_reshard` finds every old shard instead, and ``heal/shard_move.py`` cuts the new
world's shards out of them (``state/reshard.py``): still no step redone. Its result
rides to the next attempt as the outcome's state: ``{RESTORE: plan, "payload": this rank's
local shards or None}``. Design: ``docs/design/sharded.md`` ("Healing sharded state in place").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.heal.shard_move import reshard_shards
from elastic_trainer.heal.state_transfer import TransferTally, share_state
from elastic_trainer.runtime.abortable import AbortableWaits
from elastic_trainer.state.neighbour_copy import NO_STATE, Holdings, holder_of
from elastic_trainer.state.restore_plan import RESTORE, RestorePlan, ShardHolder, Source

log = logging.getLogger(__name__)

__all__ = [
    "RESTORE",
    "RestorePlan",
    "ShardHolder",
    "Source",
    "plan_reshard",
    "plan_restore",
    "restore_shards",
]


def _sources_of(shard: int, step: int, members: Sequence[Holdings | None]) -> list[Source]:
    """Everything that holds ``shard`` at ``step``, best first (live before staged, a rank's own
    before a peer's); ``Source.rank`` is the holder's new rank (its index in ``members``)."""
    found: list[Source] = []
    for rank, holding in enumerate(members):
        if holding is not None and holding.shard == shard and holding.live == step:
            found.append(Source(rank, "live"))
    for rank, holding in enumerate(members):
        if holding is not None and holding.shard == shard and step in holding.own:
            found.append(Source(rank, "own"))
    for rank, holding in enumerate(members):
        if holding is not None and (shard, step) in holding.copies:
            found.append(Source(rank, "copy"))
    return found


def _steps_held(survivors: Sequence[Holdings]) -> list[int]:
    """Every step some survivor holds anything of (live, staged or a copy), newest first."""
    return sorted(
        {h.live for h in survivors if h.live != NO_STATE}
        | {s for h in survivors for s in h.own}
        | {s for h in survivors for _, s in h.copies},
        reverse=True,
    )


def plan_restore(members: Sequence[Holdings | None], world_size: int) -> RestorePlan:
    """Pure: the newest step at which every rank's shard of the new epoch (``members[r]``: what
    new rank ``r`` holds, ``None`` for a replacement) exists somewhere, and where from.

    The shards are those of the previous epoch. When a replacement took a lost slot, every
    survivor keeps its rank and the world size its value, and each rank gets its own shard back.
    Otherwise (the world size changed, or survivors were renumbered): :func:`plan_reshard`."""
    survivors = [h for h in members if h is not None]
    newest = max((h.live for h in survivors), default=NO_STATE)
    if not survivors:
        return RestorePlan(None, reason="no survivor holds a shard", newest=newest)
    if any(
        h is not None and (h.world_size, h.rank) != (world_size, r) for r, h in enumerate(members)
    ):
        return plan_reshard(members, world_size)  # another size, or survivors renumbered
    replicas = survivors[0].replicas
    shards = world_size // replicas
    candidates = _steps_held(survivors)
    for step in candidates:
        chosen: list[Source] = []
        for rank in range(world_size):
            found = _sources_of(rank % shards, step, members)
            own = [s for s in found if s.rank == rank]
            if own:
                chosen.append(own[0])
            elif found:
                chosen.append(found[0])
            else:
                break
        else:
            every = max(h.every for h in survivors)
            return RestorePlan(step, sources=tuple(chosen), newest=newest, every=every)
    return RestorePlan(None, newest=newest, reason=_why_lost(members, world_size, shards, newest))


def plan_reshard(members: Sequence[Holdings | None], world_size: int) -> RestorePlan:
    """Pure: the newest step at which every shard of the previous epoch (``Holdings.rank`` and
    ``world_size`` are the survivors' old places) exists among ``members``, to be cut into the
    shards of ``world_size`` ranks (``state/reshard.py``); ``sources[s]``: old rank ``s``'s.
    An HSDP mesh keeps its replicas (``world_size`` must make as many): each old shard comes
    from any of its replicas and is cut over the shard dim. Survivors that disagree fall back."""
    survivors = [h for h in members if h is not None]
    newest = max((h.live for h in survivors), default=NO_STATE)
    worlds = sorted({h.world_size for h in survivors})
    if len(worlds) > 1:
        held = " and ".join(map(str, worlds))
        return RestorePlan(None, newest=newest, reason=f"the survivors held shards of {held} ranks")
    old = worlds[0]

    change = (
        f"the world changed from {old} to {world_size} ranks"
        if old != world_size
        else "survivors were renumbered"
    )

    def refuse(why: str) -> RestorePlan:
        reason = f"{change}, and {why}"
        return RestorePlan(None, newest=newest, reason=reason)

    replicas = sorted({h.replicas for h in survivors})
    if len(replicas) > 1 or old % replicas[0] or world_size % replicas[0]:
        return refuse(
            f"{world_size} ranks do not make {replicas[0]} replicas of the shards"
            if len(replicas) == 1
            else "the survivors held meshes of different shapes"
        )
    ranks = [h.rank for h in survivors]
    if len(set(ranks)) != len(ranks) or not all(0 <= r < old for r in ranks):
        return refuse(f"the survivors' old ranks {sorted(ranks)} do not fit")
    shards = old // replicas[0]  # HSDP: each old shard survives on any of its replicas
    candidates = _steps_held(survivors)
    for step in candidates:
        chosen = [_sources_of(shard, step, members) for shard in range(shards)]
        if all(chosen):
            return RestorePlan(
                step,
                sources=tuple(found[0] for found in chosen),
                newest=newest,
                every=max(h.every for h in survivors),
                old_world=old,
                new_world=world_size,
                replicas=replicas[0],
            )
    return refuse(_why_lost(members, old, shards, newest))


def _why_lost(members: Sequence[Holdings | None], world_size: int, shards: int, newest: int) -> str:
    """Which shards have no copy left at any step, in plain words."""
    survivors = [h for h in members if h is not None]
    if shards == world_size and all(h.every == 0 for h in survivors):
        return "the shard copy is off"

    def held(shard: int) -> bool:  # by anyone, at any step
        return any(
            (h.shard == shard and (h.live != NO_STATE or h.own))
            or any(s == shard for s, _ in h.copies)
            for h in survivors
        )

    missing = sorted({r % shards for r in range(world_size) if not held(r % shards)})
    if not missing:
        return f"no step at which every shard survived (the newest held: {newest})"
    if shards < world_size:
        return "; ".join(
            f"every replica of shard {s} (ranks "
            f"{', '.join(str(r) for r in range(s, world_size, shards))}) is gone"
            for s in missing
        )
    stride = survivors[0].stride if survivors else 1
    return "; ".join(
        f"rank {r}'s shard and its copy on rank {holder_of(r, world_size, stride)} are gone"
        for r in missing
    )


def restore_shards(
    holder: ShardHolder | None,
    *,
    rank: int,
    world_size: int,
    group: Any = None,
    waits: AbortableWaits | None = None,
) -> dict[str, Any] | None:
    """Collective, in a new epoch's group: gather what every member holds; ``None`` when nobody
    holds sharded state (the replicated heal applies), else ``{RESTORE: plan, "payload": ...}``
    with this rank's shard (host memory; ``None`` payload: load the newest checkpoint)."""
    started = time.monotonic()
    mine = holder.holdings() if holder is not None else None
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    if all(h is None for h in everyone):
        return None
    plan = plan_restore(everyone, world_size)
    payload = None
    tally = TransferTally()
    if plan.step is not None and plan.old_world:  # another world size: cut the old shards
        payload, refused = reshard_shards(
            holder, plan, rank=rank, group=group, waits=waits, tally=tally
        )
        if refused is not None:
            plan = RestorePlan(None, newest=plan.newest, reason=refused)
    elif plan.step is not None:
        shards = world_size // next(h for h in everyone if h is not None).replicas
        for target, source in enumerate(plan.sources):
            if source.rank == target:
                continue
            sent = None
            if rank == source.rank and holder is not None:
                sent = holder.payload(source.what, shard=target % shards, step=plan.step)
            got = share_state(
                sent,
                src=source.rank,
                device=torch.device("cpu"),
                group=group,
                waits=waits,
                level=logging.DEBUG,
                tally=tally,
            )
            if rank == target:
                payload = got
        mine_source = plan.sources[rank]
        if mine_source.rank == rank and holder is not None:
            payload = holder.payload(mine_source.what, shard=rank % shards, step=plan.step)
    if rank == 0:  # once for the group, not a line per rank and transfer (TransferTally)
        moved = f"; {tally.describe()}" if tally.shards else ""
        log.warning("heal: %s%s (%.2f s)", plan.describe(), moved, time.monotonic() - started)
    return {RESTORE: plan.to_json(), "payload": payload}
