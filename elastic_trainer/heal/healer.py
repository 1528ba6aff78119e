"""One worker's side of in-place healing: join, notice a fault, form the next epoch, go on.

    healer = Healer.create(settings, env, pg_timeout_s=...)   # None when healing is off
    env, state = healer.start(env)        # torchrun's group (or: join a running job)
    ...                                   # train; on a failed collective:
    outcome = healer.heal(step=step, snapshot=lambda: state.peer_snapshot(timeout))
    env, state = outcome.env, outcome.state   # new group, and the state to continue from

The protocol is :mod:`elastic_trainer.heal.protocol`, its etcd side
:mod:`elastic_trainer.heal.membership`, the group :mod:`elastic_trainer.heal.group`. This module
ties them to one process's life: while it trains, a round opened by anyone aborts its group at
once (from the watch's responder thread), so its training thread never waits on a dead or frozen
peer; the training thread then answers the round with the step it holds, waits for the epoch,
builds the new group and takes the newest state from a live peer. Only a process that died is
started again; it joins the same way, as does a new node; a spare waits for a round to answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.heal.group import HealableGroup, socket_inodes
from elastic_trainer.heal.membership import HealTimeoutError, Membership, RoundStopped
from elastic_trainer.heal.protocol import (
    NO_STATE,
    Epoch,
    Join,
    Member,
    Place,
    RoundRules,
    place_in,
)
from elastic_trainer.heal.sharded_restore import RESTORE, ShardHolder, restore_shards
from elastic_trainer.heal.state_transfer import share_state
from elastic_trainer.runtime.abortable import AbortableWaits
from elastic_trainer.runtime.distributed import DistEnv, announce_group, configure_nccl_environment
from elastic_trainer.runtime.failures import ABORT_MARKER, GroupAborted, is_collective_failure
from elastic_trainer.runtime.settings import HealSettings
from rendezvous import etcd_ops
from rendezvous.etcd_client import EtcdConnection
from rendezvous.etcd_store import EtcdV3Store
from rendezvous.settings import RendezvousSettings, settings_from_conf

log = logging.getLogger(__name__)

FENCE_TIMEOUT_S = 5.0
"""How long a checkpoint commit waits for etcd to confirm that its writer still belongs to the job."""


MAX_HEAL_ROUNDS = 32
"""Most rounds one heal takes part in before it gives up (:class:`HealError`: the process exits and
its launcher restarts it, the restart path). A fault during the heal costs one more round, a node
joining meanwhile one more; a heal needing more than this is a livelock, not progress."""

STUCK_IDLE_S = 5.0
"""After a round opened, a training thread still in its step that used no CPU for this long is
blocked where the abort does not reach (a wait for data longer than this is taken for one too:
that process is replaced, at the cost of a restart)."""
STOP_WATCH_INTERVAL_S = 0.25
BUCKET_WAIT_IDLE_S = 0.5
"""On gloo/CPU, a training thread inside the backward that used no CPU for this long after the
abort is blocked in a gradient bucket's wait: at the defaults DDP waits on its buckets in C++,
where no abort reaches (issue 30), and inside a CPU backward nothing else waits without computing
(a bucket of the aborted group that is not blocked fails at once)."""


def in_backward(ident: int) -> bool:
    """Whether the Python thread ``ident`` is inside ``torch.autograd``'s backward (its innermost
    Python frames; ``sys._current_frames``, documented CPython)."""
    frame = sys._current_frames().get(ident)
    depth = 0
    while frame is not None and depth < 32:
        code = frame.f_code
        if code.co_name in ("_engine_run_backward", "backward") and "autograd" in code.co_filename:
            return True
        frame, depth = frame.f_back, depth + 1
    return False


def thread_cpu_seconds(native_id: int) -> float | None:
    """User plus system CPU time of one thread of this process (``/proc``; ``None`` where that is
    not readable)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as stat_file:
            raw = stat_file.read()
        fields = raw[raw.rindex(b")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf(
            "SC_CLK_TCK"
        )  # utime, stime: fields 14 and 15
    except (OSError, ValueError, IndexError):
        return None


class HealError(RuntimeError):
    """The group could not be healed in place (the process exits; its launcher takes over)."""


class HealStopped(HealError):
    """This process was asked to stop (a signal) while it healed: it saves and exits instead."""


class RunFinished(Exception):
    """The job finished while this process waited to join it."""


@dataclass(frozen=True, slots=True)
class HealOutcome:
    """A new epoch: this process's place in it and the state to continue from."""

    env: DistEnv
    epoch: Epoch
    state: dict[str, Any] | None
    """The newest state a member held (``None``: nobody held any; load the newest checkpoint)."""
    took_s: float


def failure_reason(exc: BaseException) -> str:
    """One line in plain words for a group failure, the reason a heal round carries: a transport
    error (gloo's ``[.../pair.cc:537] Read error ...``) says that a peer is gone, not where in
    gloo that was noticed; the node that knows the root cause reports it (``describe_heal``)."""
    text = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    if isinstance(exc, GroupAborted) or ABORT_MARKER in text:
        return text
    if is_collective_failure(exc):
        return "a collective failed: a peer's connection closed (its process or node died)"
    return text


def _log_formed(epoch: Epoch, state: dict[str, Any] | None, took: float) -> None:
    """Rank 0's one line for an epoch formed: how long, why, how many, from which step."""
    continuing = epoch.step
    if state is not None and RESTORE in state:  # sharded: the step every shard survived at
        continuing = state[RESTORE]["step"] if state[RESTORE]["step"] is not None else NO_STATE
    log.warning(
        "heal: epoch %d formed in %.2f s (%s): %d member(s), continuing from step %s",
        epoch.number,
        took,
        epoch.reason,
        epoch.world_size,
        continuing if continuing != NO_STATE else "of the newest checkpoint",
    )


def heal_rendezvous(settings: HealSettings, run_id: str) -> RendezvousSettings:
    """The job's rendezvous settings as a worker inherits them from its launcher (the
    ``--rdzv-conf`` text and endpoint in its heal settings): the one place a worker parses them.

    Raises:
        HealError: they are malformed or name no endpoint.
    """
    try:
        rendezvous = settings_from_conf(
            settings.rdzv_conf, endpoint=settings.endpoint or "", run_id=run_id
        )
        rendezvous.client_config()  # an endpoint is given and the connection settings hold
    except ValueError as exc:  # RendezvousConfigError included
        raise HealError(f"in-place healing: {exc}") from exc
    return rendezvous


class Healer:
    """See the module docstring. Use :meth:`create`."""

    def __init__(
        self,
        settings: HealSettings,
        rendezvous: RendezvousSettings,
        *,
        node: str,
        local_rank: int,
        backend: str,
        device: torch.device,
        pg_timeout_s: float,
        world: tuple[int, int],
    ) -> None:
        self.settings = settings
        self.rendezvous = rendezvous
        """The job's rendezvous settings, parsed once for this process (the diagnostics
        registry's keys come from them too)."""
        self.run_id = rendezvous.run_id
        self.device = device
        config = rendezvous.client_config()
        self.connection = EtcdConnection(config)
        self.member = Member(
            id=f"{node}/{local_rank}/{os.getpid()}-{uuid.uuid4().hex[:6]}",
            slot=f"{node}/{local_rank}",
        )
        rules = RoundRules(min_world=world[0], max_world=world[1], settle_s=settings.settle_s)
        self.membership = Membership(
            self.connection, self.run_id, self.member, rules, on_round_open=self._round_opened
        )
        keep = frozenset(endpoint.port for endpoint in config.endpoints)
        # gloo can leave a collective blocked after an abort (runtime/abortable.py); NCCL's abort
        # works. CPU tensors only: a tracked future is a CPU future, which would drop the CUDA
        # stream ordering of a gloo collective on device tensors.
        self.waits = AbortableWaits(enabled=backend == "gloo" and device.type == "cpu")
        """This worker's abortable waits (handed to its loop through ``runtime.comms.WorkerComms``)."""
        self.group = HealableGroup(backend, pg_timeout_s, keep_ports=keep, waits=self.waits)
        self._init_round_state()
        self.stop_requested: Callable[[], bool] | None = None
        """True once this process got a stop signal: a heal round in progress is left
        (:class:`HealStopped`) so that it saves and exits within its grace (the trainer sets it)."""
        self.busy_probe: Callable[[], bool] | None = None
        """True while the training thread waits on work that is no hang (a checkpoint write):
        the stop watch does not count that as idle (the trainer sets it)."""
        self.heals = 0
        self.shards: ShardHolder | None = None
        """A sharded loop's shards and their copies (``heal/sharded_restore.py``): set, every
        member's shard is restored from where it survived instead of one member's whole state."""

    def _init_round_state(self) -> None:
        """What the training thread and the responder thread share about the epoch and its rounds."""
        self._phase = "starting"  # starting | training | healing | spare | finished | closed
        self._left = False  # :meth:`leave` ran
        self._phase_lock = threading.Lock()
        self._epoch: Epoch | None = None
        # EtcdV3Stores of live groups (the C++ wrapper needs the Python half).
        self._stores: list[Any] = []
        self._forming: int | None = None  # the epoch whose group this process is building
        self._abandoned = False  # a later round opened while it was being built
        self._side_group: Any = None
        self._group_aborted = False
        self._training_thread: int | None = None  # native id, for the stop watch's CPU clock
        self._training_ident: int | None = None  # Python ident, for the stop watch's frames
        self._hand_on: Callable[[int, str], object] | None = None
        # Held while handing on: the state does not move meanwhile.
        self._hand_on_lock = threading.Lock()

    @classmethod
    def create(
        cls,
        settings: HealSettings,
        env: DistEnv,
        *,
        run_id: str | None,
        node: str | None,
        pg_timeout_s: float,
    ) -> Healer | None:
        """The healer of this worker, or ``None`` when healing is off or impossible here.

        Raises:
            HealError: healing is on but misconfigured.
        """
        if not settings.enabled or not env.launched:
            return None
        if run_id is None or node is None:
            raise HealError(
                "in-place healing needs TORCHELASTIC_RUN_ID and ELASTIC_TRAINER_NODE "
                "(start the job with elastic-trainer run)"
            )
        world = settings.world or (env.world_size, env.world_size)
        return cls(
            settings,
            heal_rendezvous(settings, run_id),
            node=node,
            local_rank=env.local_rank,
            backend=env.backend,
            device=env.device,
            pg_timeout_s=pg_timeout_s,
            world=world,
        )

    # -- state -------------------------------------------------------------------------------------
    @property
    def epoch(self) -> Epoch | None:
        return self._epoch

    def check(self) -> None:
        """(Training thread, every step) raise :class:`GroupAborted` if a round opened since this
        epoch began. One attribute read."""
        if self._group_aborted:
            raise GroupAborted(
                f"a heal round after epoch {self._epoch.number if self._epoch else '?'} is open"
            )

    def offer_state(self, hand_on: Callable[[int, str], object] | None) -> None:
        """(Training thread) ``hand_on(held, reason)`` saves this process's last completed step
        unless ``held`` (the newest step another ready member of the epoch holds) covers it: what
        the stop watch calls before it ends a stuck process. Set while a training loop runs and
        kept through the heal after it (a heal only reads the model); ``None`` before anything
        writes the model again (the next loop's load; DDP's initial broadcast on a start from
        disk), which waits for a save already under way."""
        with self._hand_on_lock:
            self._hand_on = hand_on

    def commit_fence(self) -> str | None:
        """(Any thread; asked before a checkpoint is committed) ``None`` when etcd confirms, within
        :data:`FENCE_TIMEOUT_S`, that this process is a member of the job's current epoch; else why
        not. A process cut off by a partition cannot get that answer, and one the others went on
        without is not a member: neither commits a checkpoint the job does not know about."""
        try:
            response = etcd_ops.get_range(
                self.connection,
                self.membership.keys.epoch,
                what="confirming membership",
                deadline=1.0,
                retry_timeout=FENCE_TIMEOUT_S,
            )
            current = Epoch.decode(bytes(response.kvs[0].value)) if response.kvs else None
        except Exception as exc:  # noqa: BLE001 - any failure to confirm is a refusal
            return (
                f"etcd did not confirm within {FENCE_TIMEOUT_S:g} s that this process still belongs to the job "
                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            )
        if current is None:
            return "the job's membership record is gone"
        if current.rank_of(self.member.id) is None:
            return f"the job went on without this process (epoch {current.number})"
        return None

    def _set_phase(self, phase: str) -> None:
        with self._phase_lock:
            self._phase = phase
            if phase == "training":
                self._group_aborted = False

    # -- start -------------------------------------------------------------------------------------
    def start(self, env: DistEnv) -> tuple[DistEnv, dict[str, Any] | None]:
        """Create this worker's group: torchrun's (the first epoch), or, for a process started to
        join a running job, the next epoch's. Returns the environment and, for a joiner, the
        state its peers hold (``None``: load the newest checkpoint)."""
        self._training_thread = threading.get_native_id()
        self._training_ident = threading.get_ident()
        self.membership.start()
        if (
            self.settings.marker is not None
        ):  # tells the warm-start client to replace this process if it dies
            with contextlib.suppress(OSError):
                Path(self.settings.marker).touch()
        if self.settings.join:
            outcome = self._join(env, reason="join")
            return outcome.env, outcome.state
        configure_nccl_environment(self.group.timeout_s)
        if env.device.type == "cuda":
            torch.cuda.set_device(env.device)
        self.group.create(rank=env.rank, world_size=env.world_size)
        announce_group(env, self.group.timeout_s)
        self._create_side_group()
        members: list[Any] = [None] * env.world_size
        dist.all_gather_object(members, self.member)
        number = [0]
        if env.rank == 0:
            number[0] = self.membership.form(
                list(members), step=NO_STATE, reason="rendezvous"
            ).number
        dist.broadcast_object_list(number, src=0)
        if not self.membership.wait(
            lambda: (e := self.membership.epoch) is not None and e.number >= number[0], 30.0
        ):
            raise HealError(f"epoch {number[0]} written by rank 0 never arrived")
        self._epoch = self.membership.epoch
        self._set_phase("training")
        return env, None

    def _join(self, env: DistEnv, *, reason: str) -> HealOutcome:
        """A process without state: join the next round (or wait as a spare for one)."""
        self._set_phase("healing")
        started = time.monotonic()
        if not self.membership.wait(
            lambda: self.membership.epoch is not None, self.settings.timeout_s
        ):
            raise HealError(f"no running job to join in place within {self.settings.timeout_s:g} s")
        return self._round(env, step=NO_STATE, snapshot=None, reason=reason, started=started)

    # -- heal --------------------------------------------------------------------------------------
    def heal(
        self, env: DistEnv, *, step: int, snapshot: Callable[[], dict[str, Any]], reason: str
    ) -> HealOutcome:
        """After a failed collective: abort the group, form the next epoch, take the newest state.

        ``step``: the last step this process applied; ``snapshot()``: its state (called only if
        this process is the source).

        Raises:
            HealError: no epoch could be formed in time (the process should exit).
            RunFinished: the job finished meanwhile.
        """
        self._set_phase("healing")
        started = time.monotonic()
        self.group.destroy()
        return self._round(env, step=step, snapshot=snapshot, reason=reason, started=started)

    def _round(
        self,
        env: DistEnv,
        *,
        step: int,
        snapshot: Callable[[], dict[str, Any]] | None,
        reason: str,
        started: float,
    ) -> HealOutcome:
        """Rounds until this process trains in an epoch. It opens the next round only as a member,
        a replacement or a newcomer with room; outside a full epoch it waits as a spare, whatever it
        holds (a line the job left), and its heal starts when a round opens. A heal takes at most
        :data:`MAX_HEAL_ROUNDS` rounds and ``settings.timeout_s`` seconds (:class:`HealError`)."""
        deadline = started + self.settings.timeout_s
        max_world = self.membership.rules.max_world
        rounds, last = 0, ""
        while True:
            current = self.membership.epoch
            if current is None:
                raise HealError("the job's membership record is gone")
            if current.finished:
                raise RunFinished(f"the job finished at epoch {current.number}")
            number = current.number + 1
            if (
                not self.membership.round_open(number)
                and place_in(current, self.member, max_world=max_world) is Place.SPARE
            ):
                # A round it opened would close full again, having only broken the members' new
                # group: one such round per epoch formed was a livelock (heal-in-place.md, "Spares").
                self._wait_as_spare(current, left_behind=step)
                step, snapshot = NO_STATE, None
                started = time.monotonic()  # the heal starts with the round it waited for
                deadline, rounds = started + self.settings.timeout_s, 0
                continue
            if rounds >= MAX_HEAL_ROUNDS or time.monotonic() > deadline:
                raise HealError(
                    f"healing in place failed: {rounds} round(s) in {time.monotonic() - started:.1f} s "
                    f"formed no epoch this process could train in (last: {last})"
                )
            rounds += 1
            epoch = self._take_part(number, step=step, reason=reason, deadline=deadline)
            rank = epoch.rank_of(self.member.id)
            if rank is None:
                last = self._left_out(epoch, max_world=max_world)
                continue
            try:
                return self._enter(env, epoch, rank, snapshot=snapshot, started=started)
            except Exception as exc:  # a peer failed while the group formed or the state moved
                if not is_collective_failure(exc):
                    raise
                last = (
                    f"epoch {epoch.number} failed while forming "
                    f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                )
                log.warning("heal: %s; healing again", last)
                self.group.destroy()

    def _take_part(self, number: int, *, step: int, reason: str, deadline: float) -> Epoch:
        """Open round ``number`` unless it is open, answer it with ``step`` and wait for the epoch
        it forms (:class:`HealStopped` on a stop signal, :class:`RunFinished` if the job ended)."""
        try:
            if not self.membership.round_open(number):
                self.membership.open_round(number, reason)
            self.membership.answer(number, Join(self.member, ready=True, step=step))
            epoch = self.membership.settle(
                number, deadline=deadline, reason=reason, stop=self.stop_requested
            )
        except RoundStopped as exc:
            raise HealStopped(str(exc)) from exc
        except HealTimeoutError as exc:
            raise HealError(f"healing in place failed: {exc}") from exc
        if epoch.finished:
            raise RunFinished(f"the job finished at epoch {epoch.number}")
        return epoch

    def _left_out(self, epoch: Epoch, *, max_world: int) -> str:
        """Epoch ``epoch`` formed without this process: say why (one line), and return it."""
        place = place_in(epoch, self.member, max_world=max_world)
        if place is Place.REPLACED:
            # The epoch closed with this slot's previous process before this one answered: that
            # process has ended (its launcher started this one), so the epoch cannot form. The
            # next round replaces it; its members, still forming, abandon it.
            why = f"epoch {epoch.number} formed with the process this one replaces"
            log.warning("heal: %s; opening the next round", why)
        elif place is Place.SPARE:
            why = f"epoch {epoch.number} formed without this process and is full"
        else:
            why = f"epoch {epoch.number} formed without this process (late)"
            log.warning("heal: %s; joining the next one", why)
        return why

    def _wait_as_spare(self, epoch: Epoch, *, left_behind: int = NO_STATE) -> None:
        """Outside ``epoch``, which is full: wait (the responder answers every round that opens)
        until the next round opens or a later epoch forms, however long that takes. The state of
        step ``left_behind`` this process held is dropped (said in one line)."""
        if left_behind != NO_STATE:
            log.warning(
                "heal: epoch %d formed without this process and is full; its step %d is left behind",
                epoch.number,
                left_behind,
            )
        self._set_phase("spare")
        log.warning(
            "heal: the job is at its maximum size (%d); waiting as a spare", epoch.world_size
        )
        number = epoch.number + 1
        while not self.membership.wait(
            lambda: (
                self.membership.round_open(number)
                or ((e := self.membership.epoch) is not None and (e.finished or e.number >= number))
            ),
            60.0,
        ):
            pass
        self._set_phase("healing")

    def _enter(
        self,
        env: DistEnv,
        epoch: Epoch,
        rank: int,
        *,
        snapshot: Callable[[], dict[str, Any]] | None,
        started: float,
    ) -> HealOutcome:
        """Build ``epoch``'s group and move the state; abandoned (``DistStoreError``) when the next
        round opens meanwhile: a member died before it wrote its address or sent the state, and
        waiting for it would hold this process out of the round that replaces it."""
        with self._phase_lock:
            self._forming, self._abandoned = epoch.number, False
        try:
            if self.membership.round_open(epoch.number + 1):
                raise dist.DistStoreError(
                    f"round {epoch.number + 1} opened before epoch {epoch.number} formed"
                )
            return self._form(env, epoch, rank, snapshot=snapshot, started=started)
        except Exception as exc:
            if self._abandoned and not isinstance(exc, dist.DistStoreError):
                raise dist.DistStoreError(
                    f"epoch {epoch.number} abandoned while forming: {exc}"
                ) from exc
            raise
        finally:
            with self._phase_lock:
                self._forming = None

    def _form(
        self,
        env: DistEnv,
        epoch: Epoch,
        rank: int,
        *,
        snapshot: Callable[[], dict[str, Any]] | None,
        started: float,
    ) -> HealOutcome:
        store = EtcdV3Store(
            self.connection,
            f"{self.membership.keys.prefix}store/{epoch.number}",
            timeout=timedelta(seconds=60),
        )
        self._stores = [store]
        if self._abandoned:  # the next round opened before this store existed
            store.cancel()
        if env.device.type == "cuda":
            configure_nccl_environment(self.group.timeout_s)
            torch.cuda.set_device(env.device)
        self.group.create(rank=rank, world_size=epoch.world_size, store=store)
        self._create_side_group()
        state = self._take_state(epoch, rank, snapshot)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(epoch.world_size)
        new_env = dataclasses.replace(env, rank=rank, world_size=epoch.world_size)
        announce_group(new_env, self.group.timeout_s)
        self._epoch = epoch
        self.heals += 1
        took = time.monotonic() - started
        self._set_phase("training")
        if rank == 0:
            _log_formed(epoch, state, took)
        return HealOutcome(env=new_env, epoch=epoch, state=state, took_s=took)

    def _take_state(
        self, epoch: Epoch, rank: int, snapshot: Callable[[], dict[str, Any]] | None
    ) -> dict[str, Any] | None:
        """(Collective, on the side group) the state this member continues from in ``epoch``."""
        # Sharded state first: a replacement cannot know whether its peers shard, so every member
        # says what it holds (one small all-gather); nobody sharded: the replicated heal below.
        state = restore_shards(
            self.shards,
            rank=rank,
            world_size=epoch.world_size,
            group=self._side_group,
            waits=self.waits,
        )
        if state is not None or epoch.source is None:
            return state
        source = epoch.rank_of(epoch.source)
        if source is None:
            raise HealError(f"epoch {epoch.number} names a source that is not a member")
        payload = None
        if rank == source:
            if snapshot is None:
                raise HealError("chosen as the state source without state")
            payload = snapshot()
        return share_state(
            payload, src=source, device=self.device, group=self._side_group, waits=self.waits
        )

    @contextlib.contextmanager
    def adopting(self) -> Iterator[None]:
        """Process groups created inside (a device mesh's, the neighbour copy's) belong to this
        epoch's group: a round's abort shuts their connections down with the training group's
        (a survivor blocked in a collective of a subgroup without the dead rank would otherwise
        wait for the stop watch), and the next heal destroys them."""
        before = socket_inodes()
        try:
            yield
        finally:
            self.group.adopt_new_sockets(before)

    def host_group(self) -> Any:
        """(Collective) a new gloo group of this epoch's members for host-side work beside the
        training (the neighbour copy's exchange), adopted (:meth:`adopting`)."""
        with self.adopting():
            return dist.new_group(backend="gloo")

    def _create_side_group(self) -> None:
        """A gloo group of the same ranks for host-side transfers when the default group is NCCL."""
        if self.group.backend == "gloo":
            self._side_group = None
            return
        before = socket_inodes()
        self._side_group = dist.new_group(backend="gloo")
        self.group.adopt_new_sockets(before)

    # -- the responder -------------------------------------------------------------------------------
    def _round_opened(self, number: int, reason: str) -> None:
        """(Responder thread) round ``number`` opened: while training in the epoch before it, abort
        the group (the training thread fails fast and heals) and answer that this process lives.

        The aborts happen under the phase lock, in the phase they were decided in: the training
        thread, which sets the phase under the same lock before it destroys the group (and resets
        the tracked waits), never sees an abort meant for the group before land on the next one."""
        with self._phase_lock:
            phase, forming, epoch = self._phase, self._forming, self._epoch
            abandoning = forming is not None and number == forming + 1
            stopping = (
                not abandoning
                and phase == "training"
                and epoch is not None
                and number == epoch.number + 1
            )
            if abandoning:
                self._abandoned = True
                for store in self._stores:
                    store.cancel()
                self.group.abort()
                self.waits.abort(f"round {number} opened while epoch {forming} was forming")
            elif stopping:
                self._group_aborted = True
                self.group.abort()
                self.waits.abort(f"round {number} opened: {reason or 'a fault'}")
        if phase == "spare":
            self.membership.answer(number, Join(self.member, ready=True, step=NO_STATE))
            return
        if abandoning:
            log.warning(
                "heal: round %d opened while epoch %d was forming (%s); starting over",
                number,
                forming,
                reason or "a fault",
            )
            self.membership.announce(number, Join(self.member, ready=False))
            # Building a group can block where no abort reaches (gloo connecting to a peer that
            # died after it published its address): the same watch as a step's.
            self._start_stop_watch(None, number, forming=forming)
            return
        if not stopping or epoch is None:
            return
        log.warning("heal: round %d opened (%s); stopping this step", number, reason or "a fault")
        self.membership.announce(number, Join(self.member, ready=False))
        self._start_stop_watch(epoch, number)

    def _start_stop_watch(
        self, epoch: Epoch | None, number: int, *, forming: int | None = None
    ) -> None:
        threading.Thread(
            target=self._watch_stop,
            args=(epoch, number),
            kwargs={"forming": forming},
            name="heal-stop-watch",
            daemon=True,
        ).start()

    def _still_in(self, epoch: Epoch | None, forming: int | None) -> bool:
        """(Under the phase lock) the training thread is still training in ``epoch``, or (with
        ``forming``) still building epoch ``forming``'s group."""
        if forming is not None:
            return self._forming == forming
        return self._phase == "training" and self._epoch is epoch

    def _watch_stop(self, epoch: Epoch | None, number: int, *, forming: int | None = None) -> None:
        """(Thread) until the training thread leaves epoch ``epoch`` (with ``forming``: stops
        building epoch ``forming``'s group): if it used no CPU for
        :data:`STUCK_IDLE_S` (blocked on a collective that the abort did not end: gloo can leave
        one waiting out the group's timeout, see ``runtime/abortable.py``), or has not left
        within ``ready_timeout_s`` whatever it does, end this process (:meth:`_fence_if_stuck`).
        A thread that computes keeps its CPU clock moving, and one that waits for a checkpoint
        write (:attr:`busy_probe`) is not idle: both are given the full bound. On gloo/CPU a
        thread idle inside the backward is ended after :data:`BUCKET_WAIT_IDLE_S` instead: it
        waits on a gradient bucket that the abort did not end."""
        started = idle_since = time.monotonic()
        last = (
            thread_cpu_seconds(self._training_thread) if self._training_thread is not None else None
        )
        while True:
            time.sleep(STOP_WATCH_INTERVAL_S)
            with self._phase_lock:
                if not self._still_in(epoch, forming):
                    return
            now = time.monotonic()
            cpu = (
                thread_cpu_seconds(self._training_thread)
                if self._training_thread is not None
                else None
            )
            if cpu is None or cpu != last or self._busy():
                last, idle_since = cpu, now
            idle_s = now - idle_since if cpu is not None else 0.0
            idle = idle_s >= STUCK_IDLE_S or (
                idle_s >= BUCKET_WAIT_IDLE_S and self._in_bucket_wait()
            )
            if idle or now - started >= self.membership.rules.ready_timeout_s:
                self._fence_if_stuck(
                    epoch, number, waited_s=now - started, idle=idle, forming=forming
                )
                return

    def _in_bucket_wait(self) -> bool:
        """The training thread is in a CPU backward (where only a bucket wait sits idle)."""
        return (
            self.waits.enabled
            and self._training_ident is not None
            and in_backward(self._training_ident)
        )

    def _busy(self) -> bool:
        try:
            return self.busy_probe is not None and self.busy_probe()
        except Exception:  # noqa: BLE001 - a probe that fails tells nothing
            return False

    def _fence_if_stuck(
        self,
        epoch: Epoch | None,
        number: int,
        *,
        waited_s: float,
        idle: bool,
        forming: int | None = None,
    ) -> None:
        """Its training thread has not left epoch ``epoch`` to answer round ``number`` (see
        :meth:`_watch_stop`): the round cannot count on it. End the process like a crash, so that
        its launcher starts a replacement, which answers the round for the same slot (the round
        does not wait for a process whose replacement answered); the stacks go to stderr first."""
        with self._phase_lock:
            stuck = self._still_in(epoch, forming)
        if not stuck:
            return
        how = "blocked (no CPU used) for" if idle else "still in its step after"
        where = "" if forming is None else f" building epoch {forming}'s group"
        log.error(
            "heal: the training thread is %s %.0f s%s after round %d opened; ending this process so that a "
            "replacement joins (thread stacks follow)",
            how,
            waited_s,
            where,
            number,
        )
        self._hand_on_state(epoch, number)
        faulthandler.dump_traceback(all_threads=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def _hand_on_state(self, epoch: Epoch | None, number: int) -> None:
        """(Stop watch) before a stuck process ends: its state may be the only copy of the newest
        step (the other members died or are replacements), so unless a ready member of ``epoch``
        (``None``: the one being built) answered round ``number`` with that step, save it just in
        time. The round waits for this process's slot, which its replacement answers only after
        this process died, so the round reads the checkpoint after it is written; the commit fence
        refuses it once the job went on without this process."""
        with self._hand_on_lock:
            if self._hand_on is None:
                log.warning(
                    "heal: no training loop holds a completed step here (its state was moving); "
                    "nothing to hand on"
                )
                return
            among = epoch if epoch is not None else self.membership.epoch
            held = (
                self.membership.newest_ready_step(number, among=among)
                if among is not None
                else NO_STATE
            )
            try:
                self._hand_on(held, f"stuck after round {number} opened")
            except Exception as exc:  # noqa: BLE001 - the process ends either way; its replacement reads the disk
                log.error(
                    "heal: could not hand this process's state on: %s",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )

    # -- the end -------------------------------------------------------------------------------------
    def leave(self) -> None:
        """This process trains no more in the job (its loop stopped, for a signal or a peer's stop,
        or ended; once): it answers no round from now on, and takes back the answers it gave to
        rounds that opened while it was stopping, which would otherwise wait for it to become
        ready (``ready_timeout_s``, a minute) where it is only gone. If an epoch formed with its
        answer meanwhile, its members wait for it to build their group: it opens the next round,
        which they answer without it."""
        if self._left:
            return
        self._left = True
        self._set_phase("finished")  # a round opened now (a node leaving) is no reason to abort
        trained = self._epoch.number if self._epoch is not None else 0
        try:
            newest = self.membership.withdraw(after=trained)
            if (
                newest is not None
                and newest.number > trained
                and not newest.finished
                and newest.rank_of(self.member.id) is not None
            ):
                self.membership.open_round(newest.number + 1, f"{self.member.slot} left")
        except Exception as exc:  # noqa: BLE001 - the process leaves either way; a round then waits its bound
            # Not a warning: it happens when etcd is gone, which the job's own lines already say.
            log.info("heal: could not take back this process's round answers: %s", exc)

    def finish(self, env: DistEnv, step: int | None = None) -> None:
        """Training ended at ``step`` (rank 0 marks the run finished: spares and late joiners
        stop, and ``status`` says so)."""
        self.leave()
        if env.rank == 0:
            try:
                self.membership.finish(step)
            except Exception as exc:  # noqa: BLE001 - the job is done; a stale record only delays spares
                log.warning("heal: could not mark the run finished: %s", exc)

    def close(self) -> None:
        self.leave()
        self._set_phase("closed")
        try:
            self.membership.close()
            self.group.destroy()
            self.connection.close()
        finally:
            self.waits.enabled = False  # plain again for whoever still holds them
            self.waits.reset()
