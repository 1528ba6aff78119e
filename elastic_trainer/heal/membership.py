"""The etcd side of in-place healing: one worker's view of the epochs and rounds of its job.

Keys, under ``/elastic-trainer/heal/<run id>/`` (:class:`HealKeys`):

* ``epoch``: the current :class:`~elastic_trainer.heal.protocol.Epoch`; only ever replaced by a
  compare-and-swap on its own revision;
* ``round/<n>/open``: round ``n`` is open (created once, by whoever opens it);
* ``round/<n>/join/<member id>``: a process's :class:`~elastic_trainer.heal.protocol.Join`.

One prefix watch per process keeps a cache of all three (no polling; etcd sends each change once),
and a condition variable wakes the training thread. In steady state a process costs etcd that
watch and nothing else; a round costs each process two writes and, for the one that closes it,
one transaction. Callbacks from the watch never block: what a round-open event triggers (abort
the process group, answer the round) runs on this object's responder thread, in the order the
rounds opened. The responder exists only while there is a round to handle: a round-open event
starts it and it ends once nothing is left, so a healthy step carries no thread for it
(``docs/design/startup-and-threads.md``).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_trainer.heal.protocol import (
    NO_STATE,
    Decision,
    Epoch,
    Join,
    Member,
    ProtocolError,
    RoundRules,
    decide,
)
from rendezvous import etcd_ops
from rendezvous.etcd_client import EtcdConnection
from rendezvous.watch_hub import HubWatch, WatchHub

log = logging.getLogger(__name__)

KEY_ROOT = "/elastic-trainer/heal/"


class HealTimeoutError(TimeoutError):
    """A round did not close within its deadline."""


class RoundStopped(RuntimeError):
    """The waiting process was asked to stop (a signal) before the round closed."""


@dataclass(frozen=True, slots=True)
class HealKeys:
    """The etcd keys of one job's in-place healing."""

    prefix: str

    @classmethod
    def of(cls, run_id: str) -> HealKeys:
        return cls(f"{KEY_ROOT}{run_id}/")

    @property
    def epoch(self) -> str:
        return self.prefix + "epoch"

    @property
    def rounds(self) -> str:
        return self.prefix + "round/"

    def round(self, number: int) -> str:
        return f"{self.rounds}{number:012d}/"

    def open(self, number: int) -> str:
        return self.round(number) + "open"

    def join(self, number: int, member_id: str) -> str:
        return self.round(number) + "join/" + member_id

    def parse_round(self, key: str) -> tuple[int, str] | None:
        """``(round, rest)`` of a key under :attr:`rounds`."""
        if not key.startswith(self.rounds):
            return None
        number, _, rest = key[len(self.rounds) :].partition("/")
        try:
            return int(number), rest
        except ValueError:
            return None


@dataclass(slots=True)
class _Round:
    opened_by: str | None = None
    opened_at: float | None = None  # this process's monotonic clock when it saw the round open
    reason: str = ""
    joins: dict[str, Join] = field(default_factory=dict)
    arrival: dict[str, int] = field(default_factory=dict)


class Membership:
    """One process's membership client; see the module docstring.

    Args:
        connection: the etcd connection (owned by the caller).
        run_id: the job.
        member: this process.
        rules: when rounds close.
        on_round_open: called on the responder thread with the round number when a round opens
            that concerns this process (the next one after the current epoch).
    """

    def __init__(
        self,
        connection: EtcdConnection,
        run_id: str,
        member: Member,
        rules: RoundRules,
        *,
        on_round_open: Callable[[int, str], None] | None = None,
    ) -> None:
        self.connection = connection
        self.keys = HealKeys.of(run_id)
        self.member = member
        self.rules = rules
        self._on_round_open = on_round_open
        self._lock = threading.Condition()
        self._epoch: Epoch | None = None
        self._epoch_revision = 0
        self._rounds: dict[int, _Round] = {}
        self._watch: HubWatch | None = None
        self._lost: str | None = None
        self._respond_lock = threading.Lock()
        self._pending: collections.deque[tuple[int, str]] = collections.deque()
        """Rounds opened and not handled yet (guarded by ``_respond_lock``)."""
        self._responding = False
        """A responder thread runs and will see ``_pending`` (guarded by ``_respond_lock``)."""
        self._closed = False
        self._answering = threading.Lock()
        self._left = False
        """This process left the job (:meth:`withdraw`): it writes no answer any more."""

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Read the job's keys and watch them from there on."""
        revision = self._resync()
        self._watch = WatchHub.of(self.connection).watch(
            self.keys.prefix,
            start_revision=revision + 1,
            on_events=self._on_events,
            on_lost=self._on_lost,
            prefix=True,
        )

    def close(self) -> None:
        with self._respond_lock:
            self._closed = True
            self._pending.clear()
        if self._watch is not None:
            self._watch.cancel()
        with self._lock:
            self._lock.notify_all()

    # -- the view ----------------------------------------------------------------------------------
    @property
    def epoch(self) -> Epoch | None:
        with self._lock:
            return self._epoch

    def round_open(self, number: int) -> bool:
        with self._lock:
            found = self._rounds.get(number)
            return found is not None and found.opened_by is not None

    def newest_ready_step(self, number: int, *, among: Epoch) -> int:
        """The newest step that another member of ``among`` answered round ``number`` ready with
        (``NO_STATE``: none did). Only such a member can be the round's state source."""
        members = {member.id for member in among.members} - {self.member.id}
        with self._lock:
            found = self._rounds.get(number)
            joins = list(found.joins.values()) if found is not None else []
        return max((j.step for j in joins if j.ready and j.member.id in members), default=NO_STATE)

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until ``predicate()`` holds; it runs under the view's lock."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return predicate()
                self._lock.wait(min(remaining, 0.25))
                if self._lost is not None:
                    self._lock.release()
                    try:
                        self._recover()
                    finally:
                        self._lock.acquire()
            return True

    # -- writes ------------------------------------------------------------------------------------
    def form(self, members: list[Member], *, step: int, reason: str) -> Epoch:
        """Write the next epoch outright (rank 0 of a group torchrun formed): ``members`` in rank
        order, all holding the state of ``step``."""
        while True:
            with self._lock:
                current, revision = self._epoch, self._epoch_revision
            number = (current.number if current is not None else 0) + 1
            epoch = Epoch(
                number=number,
                members=tuple(members),
                step=step,
                source=None,
                started_unix=time.time(),
                reason=reason,
            )
            if self._swap_epoch(epoch, revision):
                return epoch
            self._resync()

    def open_round(self, number: int, reason: str) -> None:
        """Open round ``number`` unless someone already has."""
        conn, key = self.connection, self.keys.open(number)
        value = f"{self.member.id} {reason}".encode()
        etcd_ops.transaction(
            conn,
            [etcd_ops.absent(conn, key)],
            [etcd_ops.put(conn, key, value)],
            what="opening a heal round",
            deadline=2.0,
        )

    def answer(self, number: int, join: Join) -> None:
        """Write this process's answer to round ``number`` (none once it :meth:`withdraw`)."""
        with self._answering:
            if not self._left:
                etcd_ops.put_key(
                    self.connection,
                    self.keys.join(number, join.member.id),
                    join.encode(),
                    what="answering a heal round",
                    deadline=2.0,
                )

    def announce(self, number: int, join: Join) -> None:
        """Write a provisional answer unless this process already answered (never overwrites a
        ready one: the training thread may answer between the watch event and this write)."""
        conn, key = self.connection, self.keys.join(number, join.member.id)
        with self._answering:
            if not self._left:
                etcd_ops.transaction(
                    conn,
                    [etcd_ops.absent(conn, key)],
                    [etcd_ops.put(conn, key, join.encode())],
                    what="answering a heal round",
                    deadline=2.0,
                )

    def withdraw(self, *, after: int) -> Epoch | None:
        """This process leaves the job (its loop stopped or ended): it answers no round from now
        on and takes back its answers to the rounds after epoch ``after`` (the one it trained in),
        read from etcd, not from the watch (an answer written a moment ago may not have come
        back yet). A round waits ``ready_timeout_s`` for a member that answered provisionally to
        become ready; without its answer, a member that left is only missing, which the round
        waits ``settle_s`` for. Returns the newest epoch, read in the same request."""
        with self._answering:  # an answer being written lands first, and is read below
            self._left = True
        conn = self.connection
        found = etcd_ops.get_range(
            conn, self.keys.prefix, prefix=True, what="reading the heal state", retry_timeout=2.0
        )
        mine, newest = [], None
        for kv in found.kvs:
            key = kv.key.decode()
            parsed = self.keys.parse_round(key)
            if key == self.keys.epoch:
                newest = Epoch.decode(bytes(kv.value))
            elif parsed and parsed[0] > after and parsed[1] == f"join/{self.member.id}":
                mine.append(etcd_ops.delete(conn, key))
        if mine:
            etcd_ops.transaction(
                conn, [], mine, what="withdrawing heal rounds' answers", deadline=2.0,
                retry_timeout=2.0,
            )  # fmt: skip
        return newest

    def finish(self, step: int | None = None) -> None:
        """Mark the run finished (training ended, at ``step`` if given: the finished epoch's
        ``step`` is then the last one): spares and late joiners stop waiting."""
        while True:
            with self._lock:
                current, revision = self._epoch, self._epoch_revision
            if current is None or current.finished:
                return
            done = Epoch(
                number=current.number,
                members=current.members,
                step=current.step if step is None else step,
                source=current.source,
                started_unix=current.started_unix,
                reason=current.reason,
                finished=True,
            )
            if self._swap_epoch(done, revision):
                return
            self._resync()

    def settle(
        self, number: int, *, deadline: float, reason: str, stop: Callable[[], bool] | None = None
    ) -> Epoch:
        """Wait until epoch ``number`` (or a later one) exists, closing round ``number`` ourselves
        when the rules allow. Returns the epoch.

        Raises:
            HealTimeoutError: not formed by ``deadline`` (``time.monotonic()``).
            RoundStopped: ``stop()`` turned true first (checked at least every 50 ms).
        """
        last_note = 0.0
        while True:
            if stop is not None and stop():
                raise RoundStopped(f"stopped by a signal while round {number} was forming")
            with self._lock:
                epoch = self._epoch
                if epoch is not None and epoch.number >= number:
                    return epoch
                decision, revision = self._decide(number, reason), self._epoch_revision
            if decision is not None and decision.epoch is not None:
                if self._swap_epoch(decision.epoch, revision, drop_rounds_before=number):
                    if decision.spares:
                        log.info(
                            "heal: epoch %d is full; %d process(es) stay spares",
                            number,
                            len(decision.spares),
                        )
                    continue
                self._resync()
                continue
            now = time.monotonic()
            if now >= deadline:
                raise HealTimeoutError(
                    f"round {number} did not close: waiting for "
                    f"{decision.waiting_for if decision is not None else 'the round to open'}"
                )
            if (
                decision is not None
                and now - last_note > 10.0
                and now - (self._opened_at(number) or now) > 5.0
            ):
                log.warning("heal: round %d still waiting for %s", number, decision.waiting_for)
                last_note = now
            self.wait(
                functools.partial(self._changed_since, number, revision), min(0.05, deadline - now)
            )

    # -- internals ---------------------------------------------------------------------------------
    def _opened_at(self, number: int) -> float | None:
        with self._lock:
            found = self._rounds.get(number)
            return None if found is None else found.opened_at

    def _changed_since(self, number: int, revision: int) -> bool:
        return self._epoch_revision != revision or (
            self._epoch is not None and self._epoch.number >= number
        )

    def _decide(self, number: int, reason: str) -> Decision | None:
        """(Holding the lock) the decision on round ``number`` as this process sees it."""
        epoch = self._epoch
        found = self._rounds.get(number)
        if epoch is None or epoch.number != number - 1 or found is None or found.opened_at is None:
            return None
        joins = list(found.joins.values())
        mine = found.joins.get(self.member.id)
        if mine is None or not mine.ready:
            return None  # only a process that answered ready closes a round
        return decide(
            epoch,
            joins,
            waited_s=time.monotonic() - found.opened_at,
            rules=self.rules,
            now_unix=time.time(),
            reason=found.reason or reason,
            arrival=found.arrival,
        )

    def _swap_epoch(
        self, epoch: Epoch, revision: int, *, drop_rounds_before: int | None = None
    ) -> bool:
        conn, key = self.connection, self.keys.epoch
        compare = etcd_ops.mod_is(conn, key, revision) if revision else etcd_ops.absent(conn, key)
        ops = [etcd_ops.put(conn, key, epoch.encode())]
        if drop_rounds_before is not None:
            rpc = conn.etcd3.etcdrpc
            ops.append(
                rpc.RequestOp(
                    request_delete_range=rpc.DeleteRangeRequest(
                        key=self.keys.rounds.encode(),
                        range_end=self.keys.round(drop_rounds_before).encode(),
                    )
                )
            )
        result = etcd_ops.transaction(
            conn, [compare], ops, what="writing a heal epoch", deadline=2.0
        )
        if result.succeeded:
            with self._lock:
                if result.revision > self._epoch_revision:
                    self._epoch, self._epoch_revision = epoch, result.revision
                    self._lock.notify_all()
        return result.succeeded

    def _resync(self) -> int:
        """Read every key of the job; returns the revision read at."""
        response = etcd_ops.get_range(
            self.connection, self.keys.prefix, prefix=True, what="reading the heal state"
        )
        with self._lock:
            self._rounds.clear()
            self._epoch, self._epoch_revision = None, 0
            for kv in response.kvs:
                self._apply(
                    kv.key.decode(),
                    bytes(kv.value),
                    int(kv.mod_revision),
                    deleted=False,
                    created=int(kv.create_revision),
                )
            self._lost = None
            self._lock.notify_all()
        return int(response.header.revision)

    def _recover(self) -> None:
        try:
            revision = self._resync()
        except Exception as exc:  # etcd unreachable: the caller's deadline bounds the retries
            log.warning("heal: cannot re-read the heal state: %s", exc)
            return
        self._watch = WatchHub.of(self.connection).watch(
            self.keys.prefix,
            start_revision=revision + 1,
            on_events=self._on_events,
            on_lost=self._on_lost,
            prefix=True,
        )

    def _on_lost(self, reason: str) -> None:
        with self._lock:
            self._lost = reason
            self._lock.notify_all()

    def _on_events(self, events: list[Any]) -> None:
        deleted_type = self.connection.etcd3.events.DeleteEvent
        opened: list[tuple[int, str]] = []
        with self._lock:
            for event in events:
                key = event.key.decode() if isinstance(event.key, bytes) else str(event.key)
                deleted = isinstance(event, deleted_type)
                value = b"" if deleted else bytes(event.value)
                found = self._apply(
                    key,
                    value,
                    int(event.mod_revision),
                    deleted=deleted,
                    created=int(getattr(event, "create_revision", 0) or event.mod_revision),
                )
                if found is not None:
                    opened.append(found)
            self._lock.notify_all()
        if opened:
            self._hand_over(opened)

    def _apply(
        self, key: str, value: bytes, revision: int, *, deleted: bool, created: int
    ) -> tuple[int, str] | None:
        """(Holding the lock) apply one key change; returns ``(round, reason)`` if it opened a round."""
        if key == self.keys.epoch:
            if deleted:
                self._epoch, self._epoch_revision = None, revision
                return None
            if revision < self._epoch_revision:
                return None
            try:
                self._epoch, self._epoch_revision = Epoch.decode(value), revision
            except ProtocolError as exc:
                log.warning("heal: ignoring %s", exc)
            return None
        parsed = self.keys.parse_round(key)
        if parsed is None:
            return None
        number, rest = parsed
        if deleted:
            if rest.startswith("join/"):  # an answer taken back (:meth:`withdraw`)
                if (gone := self._rounds.get(number)) is not None:
                    gone.joins.pop(rest[len("join/") :], None)
                    if gone.opened_by is None and not gone.joins:
                        del self._rounds[number]
            else:
                self._rounds.pop(number, None)
            return None
        found = self._rounds.setdefault(number, _Round())
        if rest == "open":
            if found.opened_by is None:
                by, _, reason = value.decode(errors="replace").partition(" ")
                found.opened_by, found.reason, found.opened_at = by, reason, time.monotonic()
                return number, reason
            return None
        if rest.startswith("join/"):
            try:
                join = Join.decode(value)
            except ProtocolError as exc:
                log.warning("heal: ignoring %s", exc)
                return None
            found.joins[join.member.id] = join
            found.arrival.setdefault(
                join.member.id, created
            )  # etcd's order: the same for every process
        return None

    def _hand_over(self, opened: list[tuple[int, str]]) -> None:
        """(Watch thread) queue rounds for the responder, starting it if none runs."""
        with self._respond_lock:
            if self._closed:
                return
            self._pending.extend(opened)
            if self._responding:
                return  # the running responder takes them before it ends
            self._responding = True
        try:
            threading.Thread(target=self._respond, name="heal-responder", daemon=True).start()
        except RuntimeError:  # no thread can be started: the next round-open event tries again
            with self._respond_lock:
                self._responding = False
            log.exception("heal: cannot start the responder for round(s) %s", opened)

    def _respond(self) -> None:
        while True:
            with self._respond_lock:
                if self._closed or not self._pending:
                    self._responding = False
                    return
                number, reason = self._pending.popleft()
            if self._on_round_open is not None:
                try:
                    self._on_round_open(number, reason)
                except Exception:  # noqa: BLE001 - a responder failure must not stop later rounds
                    log.exception("heal: handling the opening of round %d failed", number)
