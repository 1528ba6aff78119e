"""What a heal of sharded state decides: where each rank's shard comes from (:class:`RestorePlan`),
what a sharded loop hands the healer (:class:`ShardHolder`), and the step the next attempt goes
on from (:func:`resume_sharded`, the checkpoint manager's load of a heal's state). The plan is
made in ``heal/sharded_restore.py`` and carried out there and in ``heal/shard_move.py`` (a
reshard); it lives beside the state so that the checkpoint manager reads it without the heal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from elastic_trainer.state.neighbour_copy import NO_STATE, Holdings

log = logging.getLogger(__name__)

RESTORE = "sharded_restore"
"""The key of a heal outcome's state that carries a :class:`RestorePlan` (as a dict)."""


class ShardHolder(Protocol):
    """What a sharded training loop registers with the healer (``NeighbourCopy`` is one)."""

    step: int

    def holdings(self) -> Holdings: ...

    def payload(self, what: str, *, shard: int, step: int) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Source:
    rank: int
    """The rank that holds the shard."""
    what: str
    """``live``, ``own`` (its staged copy) or ``copy`` (a neighbour copy it received)."""


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """Where each rank's shard comes from, or why the checkpoint has to do."""

    step: int | None
    """The step every rank restores (``None``: fall back to the newest checkpoint)."""
    sources: tuple[Source, ...] = ()
    newest: int = NO_STATE
    """The newest step any survivor held (the steps after :attr:`step` are redone)."""
    reason: str = ""
    """Why the checkpoint (``step`` is ``None``), in plain words."""
    every: int = 1
    """Steps between refreshes of the neighbour copy."""
    old_world: int = 0
    """Ranks the shards were taken at when the world size changed, or survivors were renumbered
    (a reshard in place: ``sources[s]`` is where old rank ``s``'s shard comes from); 0: the same
    world and places (``sources[r]`` is new rank ``r``'s shard)."""
    new_world: int = 0
    """Ranks after a reshard (0: no reshard)."""
    replicas: int = 1
    """(A reshard) replicas of each shard, before and after (HSDP; 1: FSDP): ``sources`` names
    the old world's ``old_world // replicas`` shards, cut into ``new_world // replicas``."""

    @property
    def old_shards(self) -> int:
        return self.old_world // self.replicas

    @property
    def new_shards(self) -> int:
        return self.new_world // self.replicas

    @property
    def redone(self) -> int:
        """Steps done before the fault that are done again (``None`` step: counted after the load)."""
        return max(0, self.newest - self.step) if self.step is not None else 0

    def describe(self) -> str:
        """One line for the log."""
        if self.step is None:
            return f"no copy of every shard survived ({self.reason})"
        if self.old_world:
            return self._describe_reshard()
        moved = [
            f"rank {r}'s from rank {s.rank}'s {'neighbour copy' if s.what == 'copy' else s.what + ' state'}"
            for r, s in enumerate(self.sources)
            if s.rank != r
        ]
        back = [r for r, s in enumerate(self.sources) if s.rank == r and s.what == "own"]
        parts = ["; ".join(moved) or "every shard where it was"]
        if back:
            parts.append(f"rank(s) {', '.join(map(str, back))} back to their staged copy")
        redone = f"{self.redone} step(s) redone"
        if self.redone and self.every > 1:
            redone += f" (the copy is refreshed every {self.every} steps)"
        return f"shards of step {self.step} restored in place ({', '.join(parts)}): {redone}"

    def _describe_reshard(self) -> str:
        whence = {"live": "live state", "own": "staged copy", "copy": "neighbour copy"}
        owner = "old rank" if self.replicas == 1 else "old shard"
        sources = "; ".join(
            f"{owner} {shard}'s from rank {s.rank}'s {whence[s.what]}"
            for shard, s in enumerate(self.sources)
        )
        mesh = (
            ""
            if self.replicas == 1
            else f" (HSDP: {self.replicas} x {self.old_shards} -> "
            f"{self.replicas} x {self.new_shards})"
        )
        return (
            f"shards of step {self.step} resharded in place from {self.old_world} to "
            f"{self.new_world} ranks{mesh} ({sources}): {self.redone} step(s) redone"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RestorePlan:
        return cls(
            step=data["step"],
            sources=tuple(Source(**s) for s in data["sources"]),
            newest=int(data["newest"]),
            reason=str(data["reason"]),
            every=int(data.get("every", 1)),
            old_world=int(data.get("old_world", 0)),
            new_world=int(data.get("new_world", 0)),
            replicas=int(data.get("replicas", 1)),
        )


def resume_sharded(
    initial: Mapping[str, Any] | None,
    *,
    restore: Callable[[Mapping[str, Any]], int],
    load: Callable[[], int | None],
    rank: int,
) -> int:
    """The step a sharded loop goes on from in a new attempt (``attempt.initial_state`` as
    ``initial``): its shards as the heal restored them (``restore(payload)``, e.g.
    ``load_local_state``), else the newest checkpoint (``load()``, collective), and then rank 0
    says in one line why the checkpoint and how many steps are redone."""
    if initial is None or RESTORE not in initial:
        return load() or 0
    plan = RestorePlan.from_json(initial[RESTORE])
    if initial["payload"] is not None:
        return restore(initial["payload"])
    step = load() or 0
    if rank == 0:
        log.warning(
            "heal: %s: every rank resumed from the newest checkpoint (step %d): %d step(s) redone",
            plan.describe(),
            step,
            max(0, plan.newest - step),
        )
    return step
