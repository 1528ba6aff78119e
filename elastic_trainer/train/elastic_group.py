"""The worker's process group over a training run, healed in place after a peer's failure.

    with ElasticGroup(settings) as group:               # forms the group (instead of init_process_group)
        ...                                             # model, optimizers, sampler: built once
        for attempt in group.attempts():                # once; again after each in-place heal
            with attempt:                               # a peer's failure is healed here
                ddp = attempt.wrap(DDP(model, init_sync=attempt.ddp_init_sync), observer)
                checkpoints = CheckpointManager(..., env=attempt.env, fence=attempt.fence)
                with attempt.loop(sampler=sampler, checkpoints=checkpoints, ...) as loop:
                    for plan in loop: ...
    result = group.result

Under ``elastic-trainer run`` (in-place healing on) a failed collective does not end the process:
the attempt's exit aborts the broken group, agrees on the new membership and the newest state
through etcd (:mod:`elastic_trainer.heal.healer`), removes the old DDP's gradient hooks, and the
next attempt goes on in the same process from the state it holds (or, for a newcomer, the state a
live peer sent). Anything else (a bug in the step, a stop) leaves the attempt as it came. Without
healing (plain torchrun, ``--heal off``) there is exactly one attempt and the group is torchrun's.
The Trainer and the own-loop API share this object. Design: ``docs/design/heal-in-place.md``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.checkpoint.files import CommitFence
from elastic_trainer.checkpoint.jit import SAVE_TIMEOUT_S
from elastic_trainer.checkpoint.manager import CheckpointManager
from elastic_trainer.heal.healer import (
    Healer,
    HealError,
    HealStopped,
    RunFinished,
    failure_reason,
)
from elastic_trainer.heal.protocol import NO_STATE
from elastic_trainer.runtime import distributed, failures, torch_compat
from elastic_trainer.runtime.comms import WorkerComms
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.exit_codes import EXIT_STOPPED
from elastic_trainer.runtime.grad_carrier import ControlCarrier
from elastic_trainer.runtime.observer import TrainingObserver
from elastic_trainer.runtime.settings import WorkerSettings
from elastic_trainer.runtime.signals import GracefulStop
from elastic_trainer.runtime.step_control import Carrier
from elastic_trainer.state.neighbour_copy import NeighbourCopy
from elastic_trainer.train.diagnostics import Diagnostics
from elastic_trainer.train.loop import (
    ElasticLoop,
    TrainResult,
    ensure_progress_logging,
)

log = logging.getLogger(__name__)


def _hand_on(loop: ElasticLoop, held: int, reason: str) -> None:
    """(The healer's stop watch, before it ends this stuck process) save the last completed step
    just in time, unless ``held``, a step a ready peer of the epoch holds, covers it, or the loop
    has not restored its state yet (the model then holds nothing a save should keep)."""
    if not loop.state_ready:
        log.warning("heal: the training loop had not restored its state yet; nothing to hand on")
        return
    checkpoints = loop.checkpoints
    step = loop.state.step
    if held >= step:
        log.warning(
            "heal: a live peer holds step %d (this process: %d); nothing to save before ending",
            held,
            step,
        )
        return
    outcome = checkpoints.just_in_time.save(reason, deadline=time.monotonic() + SAVE_TIMEOUT_S)
    log.warning("heal: handing step %d on through the disk before ending: %s", step, outcome.detail)


class ElasticGroup:
    """Owns the process group for one training run; see the module docstring.

    Args:
        settings: the worker's environment settings; parsed when omitted.
        env: this worker's place in the job; read from torchrun's environment when omitted.
        pg_timeout_s: the collective timeout; default the settings'.

    A group that already exists when the context is entered (created by the caller) is used as
    it is: no healing, and it is not destroyed at the end.
    """

    def __init__(
        self,
        settings: WorkerSettings | None = None,
        env: DistEnv | None = None,
        *,
        pg_timeout_s: float | None = None,
    ) -> None:
        self.settings = settings if settings is not None else WorkerSettings.from_environ()
        self.env = env if env is not None else distributed.read_env()
        self.pg_timeout_s = pg_timeout_s if pg_timeout_s is not None else self.settings.pg_timeout_s
        self.healer: Healer | None = None
        self.comms = WorkerComms()
        """This worker's runtime context (the healer's abortable waits once it exists)."""
        self.diagnostics: Diagnostics | None = None
        """This worker's diagnostics endpoint (``train/diagnostics.py``), once the group exists."""
        self._owns = False
        self._state: dict[str, Any] | None = None
        self._loop: ElasticLoop | None = None
        self._result: TrainResult | None = None
        self._ended = False

    @property
    def result(self) -> TrainResult | None:
        """How training ended: the last loop's result, or an empty one when the job finished
        before (or while) this process could join it. ``None`` before the end."""
        if self._result is not None:
            return self._result
        return self._loop.result if self._loop is not None else None

    @property
    def ended(self) -> bool:
        """The job finished before (or while) this process could join it: no attempt comes."""
        return self._ended

    def groups(self) -> contextlib.AbstractContextManager[None]:
        """Process groups created inside (``init_device_mesh``'s subgroups for HSDP) are aborted
        with the training group at a heal: build a sharded model in it, before the first attempt
        (``with group.groups(): first = build(group.env)``) as after a heal (``Elastic`` does it
        around ``rebuild``). A survivor blocked in a collective of a subgroup without the dead
        rank would otherwise wait for the stop watch. (DTensor's caches are emptied first: a new
        mesh equal to the last attempt's must not inherit it,
        ``torch_compat.clear_dtensor_sharding_caches``.)"""
        if self.healer is None:
            return contextlib.nullcontext()
        torch_compat.clear_dtensor_sharding_caches()
        return self.healer.adopting()

    # -- the group's life -------------------------------------------------------------------------
    def __enter__(self) -> ElasticGroup:
        self._owns = not dist.is_initialized()
        if not self._owns:
            return self
        # Before the group forms: its line names this worker's rank and pid (docs/launcher.md),
        # and a program that set up no logging would otherwise drop it (Elastic comes later).
        ensure_progress_logging(self.env.rank)
        self.healer = Healer.create(
            self.settings.heal,
            self.env,
            run_id=self.settings.run_id,
            node=self.settings.node,
            pg_timeout_s=self.pg_timeout_s,
        )
        if self.healer is not None:
            self.comms = WorkerComms(waits=self.healer.waits)
        self.diagnostics = Diagnostics.start(self.settings, self.env, self.healer)
        try:
            if self.healer is None:
                distributed.init_process_group(self.env, pg_timeout_s=self.pg_timeout_s)
                return self
            try:
                self.env, self._state = self.healer.start(self.env)
            except RunFinished:
                log.warning("the job finished before this process could join it")
                self._finish_early(step=0, epoch=0)
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close()

    def _close(self) -> None:
        if self.diagnostics is not None:
            self.diagnostics.close()
        if self.healer is not None:
            self.healer.close()
        elif self._owns:
            distributed.destroy_process_group()

    def attempts(self) -> Iterator[Attempt]:
        """One attempt, and one more after each in-place heal (none when the job finished before
        this process joined it)."""
        while not self._ended:
            attempt = Attempt(self, self.env, self._state)
            self._state = None
            if self.diagnostics is not None:
                self.diagnostics.register(self.env)
            yield attempt
            if not attempt.healed:
                return

    def _finish_early(self, *, step: int, epoch: int) -> None:
        self._ended = True
        self._result = TrainResult(
            step=step,
            epoch=epoch,
            loss=None,
            resumed_from=None,
            stopped_by_signal=False,
            checkpoint=None,
        )


class Attempt:
    """One epoch of the group: train in its ``with`` block; see the module docstring."""

    def __init__(self, group: ElasticGroup, env: DistEnv, state: dict[str, Any] | None) -> None:
        self.group = group
        self.env = env
        """This process's rank and world in this attempt (they change with a heal)."""
        self.initial_state = state
        """The state a live peer sent (a newcomer, or after a heal); ``None``: load the newest checkpoint."""
        self._from_peer = state is not None
        self.healed = False
        self._wrappers: list[weakref.ref[Any]] = []
        self._releases: list[Callable[[], None]] = []
        self._shards: Any = None
        self._carrier: Carrier | None = None

    def carry(self, carrier: Carrier | None) -> None:
        """The step's control rides on ``carrier`` in this attempt's loop (a sharded model's:
        ``ShardCarrier``; a DDP model's comes with :meth:`wrap`)."""
        self._carrier = carrier

    # -- a sharded loop of your own (docs/design/sharded.md, "Healing sharded state in place") ----
    def hold(self, shards: Any) -> None:
        """A loop without :meth:`loop` over sharded state: ``shards`` (a ``NeighbourCopy``) says
        the step it holds and hands on its shards and their copies when the group heals."""
        self._shards = shards
        if self.group.healer is not None:
            self.group.healer.shards = shards

    def copy_shards(
        self, source: Callable[[int], dict[str, Any]], *, every: int, replicas: int = 1
    ) -> NeighbourCopy:
        """(Collective) this attempt's neighbour copy of a sharded state (``source(step)``: this
        rank's local shards, ``ShardedState.local_state``), on a host group of its own (FSDP
        ring; an HSDP mesh's replicas are the copies), :meth:`hold` by the attempt. ``every``
        0: no copy, and a heal reloads the newest checkpoint. Start it once the state is loaded
        (``copies.start(step)``)."""
        ring = replicas == 1 and every > 0 and self.env.world_size > 1
        copies = NeighbourCopy(
            source,
            env=self.env,
            every=every,
            group=self.host_group() if ring else None,
            replicas=replicas,
        )
        self.hold(copies)
        return copies

    @property
    def heals_in_place(self) -> bool:
        """Whether a peer's failure heals in this process (``elastic-trainer run``) rather than
        ending it for a restart (plain torchrun, ``--heal off``), where the checkpoint manager
        saves the shards held just in time."""
        return self.group.healer is not None

    def groups(self) -> contextlib.AbstractContextManager[None]:
        """:meth:`ElasticGroup.groups` (a rebuilt model's mesh is made in it)."""
        return self.group.groups()

    def host_group(self) -> Any:
        """(Collective) a gloo group of this attempt's ranks for host-side work beside training,
        aborted with the training group at a heal."""
        healer = self.group.healer
        return healer.host_group() if healer is not None else dist.new_group(backend="gloo")

    @property
    def ddp_init_sync(self) -> bool:
        """DDP's ``init_sync`` for this attempt's model. ``False`` when the attempt starts from a
        peer's state: every member restores that same payload when its loop starts, so DDP's
        construction-time broadcast of rank 0's module would be redundant, and it is the one
        collective between a heal and the next loop that no abort reaches. A process stuck there
        would end with its state being overwritten, with nothing to hand on
        (``docs/design/heal-in-place.md``). ``True`` for a start from disk or from scratch."""
        return not self._from_peer

    @property
    def fence(self) -> CommitFence | None:
        """The checkpoint commit fence (``CheckpointManager(fence=...)``): a process the job went on
        without never commits a checkpoint. ``None`` without in-place healing."""
        return self.group.healer.commit_fence if self.group.healer is not None else None

    def wrap(
        self,
        ddp: torch.nn.parallel.DistributedDataParallel,
        observer: TrainingObserver | None = None,
        *,
        release: Callable[[], None] | None = None,
    ) -> torch.nn.parallel.DistributedDataParallel:
        """Take ``ddp`` (built on this attempt's group) into the attempt: the observer's allreduce
        timing and, at a heal, its gradient hooks removed. At the defaults no comm hook is
        registered: DDP reduces its buckets in C++ (``docs/design/steady-state.md``).
        ``release``: called at a heal, before the state moves, to drop the caller's references to
        ``ddp`` (its buckets are as large as the gradients). Returns ``ddp``."""
        if observer is not None:
            observer.wrap_ddp(ddp)
        carrier = ddp.module if isinstance(ddp.module, ControlCarrier) else None
        if carrier is not None:
            carrier.bind(ddp)
        self._carrier = carrier
        self._wrappers.append(weakref.ref(ddp))
        if release is not None:
            self._releases.append(release)
        return ddp

    def loop(self, **options: Any) -> ElasticLoop:
        """An :class:`ElasticLoop` for this attempt (``options``: the loop's, less ``env`` and the
        healing ones, which the attempt supplies)."""
        healer = self.group.healer
        loop = ElasticLoop(
            env=self.env,
            heals_in_place=healer is not None,
            initial_state=self.initial_state,
            generation_part=healer.heals if healer is not None else 0,
            heal_check=healer.check if healer is not None else None,
            control_carrier=self._carrier,
            comms=self.group.comms,
            diagnostics=self.group.diagnostics,
            **options,
        )
        self.initial_state = None
        if healer is not None:
            checkpoints: CheckpointManager = loop.checkpoints
            healer.busy_probe = lambda: checkpoints.writing
            healer.offer_state(partial(_hand_on, loop))
        self.group._loop = loop
        return loop

    def __enter__(self) -> Attempt:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        healer = self.group.healer
        try:
            return self._end(exc)
        finally:
            if healer is not None:
                healer.offer_state(
                    None
                )  # what writes the model next (DDP's broadcast, a load) comes after

    def _end(self, exc: BaseException | None) -> bool:
        """:meth:`__exit__`: heal after a group failure (the loop's offer to hand its state on
        stands meanwhile: a heal only reads the model)."""
        group, healer = self.group, self.group.healer
        loop = group._loop
        if exc is None:
            self._finished(loop)
            return False
        if (
            healer is None
            or not isinstance(exc, Exception)
            or not failures.is_collective_failure(exc)
        ):
            return False  # a group that restarts: its loop kept the survivors' evidence
        if loop is not None and not loop.heals_in_place:
            log.warning(
                "heal: this state cannot be handed on by a peer (sharded: each rank holds only its "
                "own shards); restarting from the newest checkpoint"
            )
            return False
        diagnostics = group.diagnostics
        directory = loop.checkpoints.directory if diagnostics and loop is not None else None
        evidence = (
            diagnostics.evidence(self.env, exc)
            if diagnostics is not None and directory is not None
            else None
        )
        holds = loop is not None and loop.state_ready and loop.state.consistent
        self._detach_wrappers()
        step, snapshot = self._held(loop, holds)
        healed = self._heal(healer, exc, loop, holds=holds, step=step, snapshot=snapshot)
        if healed and diagnostics is not None and evidence is not None and healer.epoch is not None:
            folder = f"{healer.epoch.number:06d}-heal"
            diagnostics.keep_evidence(directory, folder, group.env.rank, evidence, launchers=True)
        return healed

    def _finished(self, loop: ElasticLoop | None) -> None:
        """The attempt ended without an error: tell the healer when training finished."""
        healer = self.group.healer
        if healer is None:
            return
        if loop is not None and loop.result is not None and loop.result.finished:
            healer.finish(self.env, loop.result.step)
        elif loop is None and self._shards is not None:
            healer.finish(self.env, self._shards.step)  # a sharded loop of its own ended
        else:
            healer.leave()  # stopped (a signal, a peer's stop): no round waits for this process

    def _held(
        self, loop: ElasticLoop | None, holds: bool
    ) -> tuple[int, Callable[[], dict[str, Any]]]:
        """The step this process holds for the heal, and how to snapshot it for a peer."""
        step = loop.step if holds and loop is not None else NO_STATE
        snapshot: Callable[[], dict[str, Any]] = (
            partial(loop.state.peer_snapshot, SAVE_TIMEOUT_S) if loop is not None else dict
        )
        if self._shards is not None:  # sharded (hold): each shard is restored where it survived
            step, snapshot = self._shards.step, dict
        elif loop is not None and loop.state.sharded is not None:
            # A sharded attempt that failed before it held its copy (a fault while it rebuilt):
            # no peer can use this rank's shards; the job goes on from the newest checkpoint.
            step, snapshot = NO_STATE, dict
        # A round that opens before the loop restored the state a peer just sent (a second fault
        # right after a heal, or a member late for the last round): that state is still this
        # process's to hand on, so the job goes on from its step, not from the last checkpoint.
        unrestored = (
            self.initial_state
            if self.initial_state is not None
            else (
                getattr(loop, "_initial_state", None)
                if loop is not None and not loop.state_ready
                else None
            )
        )
        if not holds and isinstance(unrestored, dict) and isinstance(unrestored.get("step"), int):
            return unrestored["step"], (lambda: unrestored)
        return step, snapshot

    def _heal(
        self,
        healer: Healer,
        exc: Exception,
        loop: ElasticLoop | None,
        *,
        holds: bool,
        step: int,
        snapshot: Callable[[], dict[str, Any]],
    ) -> bool:
        """Heal the group in place (True), or end this process: a stop signal (exit status
        :data:`EXIT_STOPPED`), the job's end (True, no next attempt), a failed heal (``exc``)."""
        group = self.group
        # The loop's stop handler is gone: a stop signal during the heal is this one's, and one
        # that came before it (the node is being stopped) means no heal at all.
        signalled = loop is not None and loop.stop_requested
        stop = GracefulStop(group.settings.sigterm_grace_s)
        if not signalled:
            stop.install()
        healer.stop_requested = lambda: signalled or stop.requested
        try:
            if signalled:
                raise HealStopped("stopped by a signal as its group failed")
            outcome = healer.heal(
                self.env, step=step, snapshot=snapshot, reason=failure_reason(exc)
            )
        except HealStopped as stopped:
            log.warning("%s: saving this process's step and exiting instead of healing", stopped)
            if holds and loop is not None:
                _hand_on(loop, NO_STATE, str(stopped))
            raise SystemExit(EXIT_STOPPED) from exc
        except RunFinished:
            log.warning("the job finished while this process healed")
            group._finish_early(
                step=loop.step if loop is not None else 0,
                epoch=loop.sampler.epoch if loop is not None else 0,
            )
            return True
        except HealError as heal_exc:
            log.error("%s; falling back to a restart", heal_exc)
            if holds and loop is not None:
                loop.checkpoints.just_in_time.after_failure(exc)
            raise exc from heal_exc
        finally:
            stop.uninstall()
            healer.stop_requested = None
        group.env, group._state = outcome.env, outcome.state
        healer.shards = (
            None  # the next attempt's loop holds its own (until then: nothing to hand on)
        )
        self.healed = True
        return True

    def _detach_wrappers(self) -> None:
        """The DDP of the broken group must not reduce another gradient, whoever still holds it."""
        for release in self._releases:
            release()
        self._releases.clear()
        for ref in self._wrappers:
            ddp = ref()
            if ddp is not None:
                torch_compat.detach_ddp(ddp)
        self._wrappers.clear()
        gc.collect()
