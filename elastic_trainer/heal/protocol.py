"""The membership protocol of in-place healing, as data and one pure decision.

A job trained in place runs in *epochs*: an epoch is a numbered membership (the ordered members
are ranks ``0..n-1``) plus the step every member starts it from and the member whose state the
others take. The first epoch is torchrun's rendezvous; every later one is formed by a *round*:

1. Anyone who sees the group fail (a collective raised, a watchdog killed a frozen peer) or wants
   in (a replacement, a new node below the maximum) opens round ``n + 1`` (one create-if-absent
   write). A spare, outside a full epoch, opens none: it answers the rounds others open
   (:func:`place_in`).
2. Every live member sees the round open (a watch), aborts its process group so that nothing
   waits on a dead peer, and says it is alive (a *provisional* join); once its training thread
   has stopped, its step is final and it joins for real (``ready``, with its step).
3. Any ready member closes the round when :func:`decide` says so, with a compare-and-swap on the
   epoch key: exactly one new epoch wins. The ranks keep the previous epoch's order (a
   replacement takes the slot, and so the rank, of the process it replaces), newcomers follow.
4. Every member of the new epoch builds a new process group and takes the state of the member
   with the highest step (the others hold the same state, or older: none holds newer).

Invariants: an epoch is only ever written by a compare-and-swap on the previous one (no two
histories); a member never trains in an epoch it is not listed in; the state of the new epoch
is the newest any of its members holds, so no committed step is lost. A process that cannot
reach etcd cannot join, so a partitioned node cannot form or join an epoch on its own.
Design: ``docs/design/heal-in-place.md``.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

NO_STATE = -1
"""The step of a member that holds no training state (a new process)."""


class ProtocolError(ValueError):
    """A record in etcd that this protocol cannot read."""


@dataclass(frozen=True, slots=True)
class Member:
    """One worker process: ``id`` is unique per process, ``slot`` per node and local rank (a
    replacement process has a new id and the same slot)."""

    id: str
    slot: str

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "slot": self.slot}

    @classmethod
    def from_json(cls, data: Any) -> Member:
        try:
            return cls(id=str(data["id"]), slot=str(data["slot"]))
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"bad member record {data!r}") from exc


@dataclass(frozen=True, slots=True)
class Epoch:
    """A membership: ``members[r]`` is rank ``r``."""

    number: int
    members: tuple[Member, ...]
    step: int
    """The step every member starts this epoch from (``NO_STATE``: from the newest checkpoint)."""
    source: str | None
    """The member whose state everyone takes (``None``: nobody holds any; load the checkpoint)."""
    started_unix: float
    reason: str
    finished: bool = False
    """Training ended: nobody heals into this run any more."""

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member_id: str) -> int | None:
        for rank, member in enumerate(self.members):
            if member.id == member_id:
                return rank
        return None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "number": self.number,
                "members": [m.to_json() for m in self.members],
                "step": self.step,
                "source": self.source,
                "started_unix": self.started_unix,
                "reason": self.reason,
                "finished": self.finished,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> Epoch:
        try:
            data = json.loads(raw)
            return cls(
                number=int(data["number"]),
                members=tuple(Member.from_json(m) for m in data["members"]),
                step=int(data["step"]),
                source=None if data["source"] is None else str(data["source"]),
                started_unix=float(data["started_unix"]),
                reason=str(data["reason"]),
                finished=bool(data.get("finished", False)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"bad epoch record: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Join:
    """A process's answer to a round."""

    member: Member
    ready: bool
    """False: provisional (alive; its training thread is still stopping)."""
    step: int = NO_STATE
    """The last step whose update this process applied (``NO_STATE``: it holds no state)."""

    @property
    def has_state(self) -> bool:
        return self.step != NO_STATE

    def encode(self) -> bytes:
        return json.dumps(
            {"member": self.member.to_json(), "ready": self.ready, "step": self.step},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> Join:
        try:
            data = json.loads(raw)
            return cls(
                member=Member.from_json(data["member"]),
                ready=bool(data["ready"]),
                step=int(data["step"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"bad join record: {exc}") from exc


@dataclass(frozen=True, slots=True)
class RoundRules:
    """When a round may close."""

    min_world: int
    """Fewest members an epoch may have (``min_nodes`` x workers per node)."""
    max_world: int
    """Most members an epoch may have; ready processes beyond it stay spares."""
    settle_s: float = 0.5
    """How long after the round opened a member of the previous epoch that has not answered
    counts as gone (a live process answers on its watch thread within milliseconds)."""
    ready_timeout_s: float = 60.0
    """How long to wait for a process that answered provisionally (alive) to become ready."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_world <= self.max_world:
            raise ValueError(
                f"world sizes: need 1 <= min ({self.min_world}) <= max ({self.max_world})"
            )
        if not (self.settle_s >= 0 and self.ready_timeout_s >= self.settle_s):
            raise ValueError("timeouts: need 0 <= settle_s <= ready_timeout_s")


@dataclass(frozen=True, slots=True)
class Decision:
    """What :func:`decide` found: ``epoch`` to write now, or why not yet."""

    epoch: Epoch | None
    waiting_for: str = ""
    spares: tuple[Member, ...] = field(default=())


class Place(enum.Enum):
    """Where a process stands towards an epoch (:func:`place_in`)."""

    MEMBER = "member"
    """Listed: it trains in the epoch."""
    REPLACED = "replaced"
    """Its slot is listed under another process, the one it replaces (which has ended): the epoch
    cannot form, and the next round must replace that process."""
    SPARE = "spare"
    """Not listed, and the epoch is full: it waits, answering rounds others open, and opens none."""
    OUTSIDE = "outside"
    """Not listed, and the epoch has room: it opens the next round to join."""


def place_in(epoch: Epoch, member: Member, *, max_world: int) -> Place:
    """Where ``member`` stands towards ``epoch``.

    A process outside a full epoch is a spare whatever state it holds: that state is of a line the
    epoch left (only a member of the epoch being replaced hands state on, :func:`decide`), and a
    round it opened would close with it beyond the maximum again, having only broken the members'
    new group; such rounds, one per epoch formed, were a livelock (``docs/design/heal-in-place.md``,
    "Spares")."""
    if epoch.rank_of(member.id) is not None:
        return Place.MEMBER
    if any(m.slot == member.slot for m in epoch.members):
        return Place.REPLACED
    return Place.SPARE if epoch.world_size >= max_world else Place.OUTSIDE


def _order(previous: Epoch, ready: Iterable[Join], arrival: Mapping[str, int]) -> list[Join]:
    """One join per slot, in rank order: the previous epoch's slots keep their order, then
    newcomers in the order they joined.

    A slot's join is its newest process's (the last to arrive): a launcher starts a process for a
    slot only once the one before it ended, so an older process of the slot is dead, whatever
    state it said it held (a survivor that answered and was then ended by its launcher's restart
    of the whole group). Same arrival: the newest state, then the id (deterministic)."""
    by_slot: dict[str, Join] = {}
    for join in ready:
        current = by_slot.get(join.member.slot)
        if current is None or _newer(join, current, arrival):
            by_slot[join.member.slot] = join
    rank_of_slot = {member.slot: rank for rank, member in enumerate(previous.members)}

    def key(join: Join) -> tuple[float, int, str]:
        rank = rank_of_slot.get(join.member.slot)
        return (math.inf if rank is None else rank, arrival.get(join.member.id, 0), join.member.id)

    return sorted(by_slot.values(), key=key)


def _newer(join: Join, other: Join, arrival: Mapping[str, int]) -> bool:
    """Whether ``join`` supersedes ``other`` for their slot (see :func:`_order`)."""

    def rank(j: Join) -> tuple[int, int, str]:
        return (arrival.get(j.member.id, 0), j.step, j.member.id)

    return rank(join) > rank(other)


def decide(
    previous: Epoch,
    joins: Sequence[Join],
    *,
    waited_s: float,
    rules: RoundRules,
    now_unix: float,
    reason: str,
    arrival: Mapping[str, int] | None = None,
) -> Decision:
    """Whether round ``previous.number + 1`` can close after ``waited_s`` seconds, given its joins.

    The state goes on from the member of ``previous`` with the newest step (a process that was
    not a member of ``previous`` is never the source). It closes at once when every slot of
    ``previous`` answered ready (the member itself or its
    replacement) and nobody is still provisional; otherwise once ``settle_s`` has passed and
    every provisional process became ready (or ``ready_timeout_s`` passed). A provisional process
    whose slot a ready replacement answered for is not waited for: its launcher starts a
    replacement only once it died (a process stuck in its step ends itself, ``heal/healer.py``).
    It needs at least ``min_world`` ready processes; beyond ``max_world`` the rest are spares.
    ``arrival``: member id -> order of its first record (ties and newcomers' ranks).
    """
    arrival = arrival or {}
    ready = [j for j in joins if j.ready]
    ready_ids = {j.member.id for j in ready}
    answered = {j.member.slot for j in ready}
    provisional = [
        j
        for j in joins
        if not j.ready and j.member.id not in ready_ids and j.member.slot not in answered
    ]
    missing = [m for m in previous.members if m.slot not in answered]
    if missing or provisional:
        if waited_s < rules.settle_s:
            return Decision(None, f"{len(missing)} member(s) of epoch {previous.number} to answer")
        if provisional and waited_s < rules.ready_timeout_s:
            return Decision(None, f"{len(provisional)} live member(s) to stop their step")
    ordered = _order(previous, ready, arrival)
    if len(ordered) < rules.min_world:
        return Decision(None, f"at least {rules.min_world} members (have {len(ordered)})")
    chosen, spares = ordered[: rules.max_world], ordered[rules.max_world :]
    # Only the epoch being replaced can hand on its state: a process that missed it (late for the
    # round that formed it, its etcd unreachable) holds an older line of training, which the
    # epoch's members may have moved past or diverged from, however high its step.
    members = {m.id for m in previous.members}
    holders = [j for j in chosen if j.has_state and j.member.id in members]
    step = max((j.step for j in holders), default=NO_STATE)
    source = next((j.member.id for j in holders if j.step == step), None)
    epoch = Epoch(
        number=previous.number + 1,
        members=tuple(j.member for j in chosen),
        step=step,
        source=source,
        started_unix=now_unix,
        reason=reason,
    )
    return Decision(epoch, spares=tuple(j.member for j in spares))
