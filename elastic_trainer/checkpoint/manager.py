"""The checkpoint manager: the training state to and from disk, and nothing else.

    state = TrainingState({"model": model, "optimizer": opt, "sampler": sampler}, env=env, seed=0)
    manager = CheckpointManager(CheckpointConfig(directory="/ckpt", every=100), env=env, state=state,
                                fingerprint={"model": model_signature(model.state_dict())})
    step = manager.load() or 0                 # collective: rank 0 chooses, every rank loads
    ...
    with state.update(step + 1):               # the optimizer step, scheduler, sampler advance
        optimizer.step()
    if manager.due(step + 1):
        manager.save()                         # collective

What is saved is the :class:`~elastic_trainer.state.training_state.TrainingState`'s; this object
decides when (due), where (the directory, the file format, the claims and the commit fence) and
which file a start resumes from (load, fallback), and it writes the just-in-time save.

It owns the resume choice (rank 0 picks the newest good checkpoint of this job, broadcasts it,
every rank loads it with a ``map_location`` onto its own device and ``weights_only=True``),
periodic and final saves (atomic files, one writer per step through claims, optionally on a
background thread), and the just-in-time save of :mod:`elastic_trainer.checkpoint.jit`: a
surviving rank saving the last completed step (a snapshot under the state's guard) when the group
fails. It reads its :class:`~elastic_trainer.checkpoint.config.CheckpointConfig` once. The files
are those of
:mod:`elastic_trainer.checkpoint.files`: ``torch.load(path, weights_only=True)["model"]`` is a plain
state_dict, and ``elastic-trainer checkpoint list|verify|inspect`` reads them.

A sharded state (``TrainingState.sharded``: an FSDP2 model) is written in the sharded format of
:mod:`elastic_trainer.checkpoint.sharded` instead: every save is collective, every rank writes its
own shards (asynchronously by default, through DCP on the checkpoint's own gloo group), rank 0
commits; a load reads each rank's pieces, resharded onto the current world. That choice is the
state's, made once; the manager only follows it (``docs/design/sharded.md``). Its just-in-time
save writes, with no collective, every shard this rank holds: with the state's neighbour copy
(``TrainingState.copies``) a lost rank's too (``checkpoint/sharded_jit.py``), else its own only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint import sharded, sharded_jit
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.checkpoint.jit import SAVE_TIMEOUT_S, ExitTimer, JitCheckpointer, JitOutcome
from elastic_trainer.checkpoint.staging import StagingBuffers
from elastic_trainer.heal.restore_plan import RESTORE
from elastic_trainer.heal.sharded_restore import resume_sharded
from elastic_trainer.runtime import rng
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.observer import NullObserver, TrainingObserver
from elastic_trainer.runtime.settings import WorkerSettings
from elastic_trainer.state.training_state import Stateful, TrainingState

log = logging.getLogger(__name__)

TEARDOWN_S = 10.0
"""After a failure, the just-in-time save plus the teardown must end within ``SAVE_TIMEOUT_S +
TEARDOWN_S``; past that the process exits (code 1) instead of hanging."""


class CheckpointManager:
    """Checkpoints of one worker's training state; see the module docstring.

    Args:
        config: the checkpoint section.
        env: this worker's place in the job.
        state: what is saved and restored.
        states: instead of ``state``: name -> object (a :class:`TrainingState` of them is made).
        fingerprint: what identifies the job (model signature, dataset size, seed, ...): another
            job's checkpoint is refused, never loaded or overwritten.
        model: with ``states``: the module whose buffers a snapshot takes from rank 0.
        settings: the worker's environment (``ELASTIC_TRAINER_JIT_SAVE``); parsed when omitted.
        observer: told of saves and loads (metrics).
        run_config: stored in every checkpoint as ``"config"`` (plain data).
        stop_deadline: the graceful stop's deadline (``time.monotonic()``), if one is running.
        fence: asked before every checkpoint is committed (periodic, final, just in time); a
            refusal leaves the directory as it was (see :func:`ckpt.save_checkpoint`).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        env: DistEnv,
        state: TrainingState | None = None,
        states: Mapping[str, Stateful | None] | None = None,
        fingerprint: Mapping[str, Any],
        model: nn.Module | None = None,
        settings: WorkerSettings | None = None,
        observer: TrainingObserver | None = None,
        run_config: Mapping[str, Any] | None = None,
        stop_deadline: Callable[[], float | None] = lambda: None,
        fence: ckpt.CommitFence | None = None,
    ) -> None:
        self.config = config
        self.env = env
        if (state is None) == (states is None):
            raise ValueError("CheckpointManager takes either state= or states=")
        self.fingerprint_fields = dict(fingerprint)
        self.state = (
            state
            if state is not None
            else TrainingState(
                states or {}, env=env, model=model, seed=self.fingerprint_fields.get("seed")
            )
        )
        self.settings = settings if settings is not None else WorkerSettings.from_environ()
        self.observer: TrainingObserver = observer if observer is not None else NullObserver()
        self.run_config = dict(run_config or {})
        self._stop_deadline = stop_deadline
        self._fence = fence
        self._sync_writing = False
        self.resumed_from: int | None = None
        self.last_path: str | None = None
        self._committed_path: str | None = None  # the last path before a background write in flight
        self._last_saved_step: int | None = None
        self._sharded: sharded.ShardedCheckpointer | None = None
        if self.state.sharded is not None and config.directory is not None:
            # Collective (the checkpoint's own process group): every rank builds its manager here.
            self._sharded = sharded.ShardedCheckpointer.for_job(
                config, env=env, fingerprint_fields=self.fingerprint_fields, fence=fence
            )
        # Rank 0's writer of single files, or this rank's writer of its shards.
        self._writer = (
            self._sharded.writer if self._sharded is not None else ckpt.AsyncCheckpointWriter()
        )
        self._writer.on_refused = self._background_write_refused
        self._staging = StagingBuffers(env.device)
        self._failure: ckpt.CheckpointError | None = None
        self._jit = JitCheckpointer(
            guard=self.state.guard,
            directory=None,
            rank=env.rank,
            step=lambda: self.step,
            payload=dict,
            write=lambda step, payload: "",
            enabled=False,
        )
        self._deadline: ExitTimer | None = None
        self._shard_saver: sharded_jit.ShardedJit | None = None
        self._training_thread: int | None = None

    # -- properties ----------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps completed (the state's)."""
        return self.state.step

    @property
    def states(self) -> dict[str, Stateful | None]:
        """The objects saved (the state's)."""
        return self.state.objects

    @property
    def directory(self) -> str | None:
        return self.config.directory

    @property
    def jit_enabled(self) -> bool:
        return self._jit.enabled

    def use_stop_deadline(self, deadline: Callable[[], float | None]) -> None:
        """Where the graceful stop's deadline comes from (the loop that owns the stop signal)."""
        self._stop_deadline = deadline

    def due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due after ``step``."""
        return self.directory is not None and step % self.config.every == 0

    # -- resume --------------------------------------------------------------------------------------
    def load(self, initial: Mapping[str, Any] | None = None) -> int | None:
        """Collective: restore the state this attempt goes on from; returns its step (``None``:
        none, start from scratch). Also sets up the just-in-time save.

        Without ``initial``: the newest good checkpoint of this job (rank 0 chooses, and decides
        for every rank whether to save just in time; every rank loads the same checkpoint onto
        its own device, a sharded one resharded onto this world). With ``initial``, a heal's
        state (``Attempt.initial_state``): a peer's payload, restored with no file and no
        collective; or for a sharded state ``{RESTORE: plan, "payload": ...}``, this rank's
        shards as the heal gathered them, else (no copy of every shard survived) the newest
        checkpoint, and rank 0 says in one line how many steps are redone
        (``heal.sharded_restore.resume_sharded``).

        Raises:
            CheckpointMismatchError: the directory holds another job's checkpoints.
            CheckpointError: the directory cannot be used.
        """
        if initial is None:
            return self._load_newest()
        if RESTORE in initial:
            resume_sharded(
                initial, restore=self._restore, load=self._load_newest, rank=self.env.rank
            )
            return self.resumed_from
        return self._restore(initial)

    def _load_newest(self) -> int | None:
        """:meth:`load` of the newest good checkpoint."""
        env = self.env
        decision: list[Any] = [None, self._jit_wanted()]
        if self.directory is not None and env.is_rank0:
            # Before the choice removes them: a just-in-time set of shards that never completed.
            lost = (
                sharded_jit.describe_incomplete(self.directory, ckpt.newest_step(self.directory))
                if self._sharded is not None
                else None
            )
            decision[0] = self._choose()
            if lost is not None:
                log.warning("%s", lost)
        if env.world_size > 1:
            dist.broadcast_object_list(decision, src=0)
        value = ckpt.chosen_path(decision[0])
        if value is not None:
            started = time.monotonic()
            if self._sharded is not None:
                state = self._load_sharded(Path(value))
            elif os.path.isdir(value):
                raise ckpt.CheckpointError(
                    f"checkpoint {value} is sharded (FSDP2), but the model is not sharded; resume "
                    "it with the sharded model, or turn it into one file with `elastic-trainer "
                    "checkpoint export`"
                )
            else:
                state = ckpt.load_checkpoint(value, env.device)
                self.state.load_state_dict(state)
            self.observer.on_checkpoint_loaded(
                step=self.step, duration_s=time.monotonic() - started, nbytes=_size(value)
            )
            self.resumed_from = self._last_saved_step = self.step
            self.last_path = value
            if env.is_rank0:
                log.info(
                    "resumed from %s%s (step %d, epoch %d, saved by %d ranks, now %d); %s",
                    value,
                    " (a just-in-time checkpoint)" if state.get("jit") else "",
                    self.step,
                    self.state.epoch,
                    state["world_size"],
                    env.world_size,
                    resume_claim(self.state),
                )
        elif env.is_rank0 and self.directory is None:
            log.warning(
                "no checkpoint_dir: this job is not fault tolerant; a restart starts again from step 0 "
                "(give a checkpoint directory that every node shares, e.g. --checkpoint-dir)"
            )
        elif env.is_rank0:
            log.info("starting from scratch (no usable checkpoint in %s)", self.directory)
        self._setup_jit(bool(decision[1]))
        return self.resumed_from

    def _load_sharded(self, path: Path) -> dict[str, Any]:
        """Collective: read this rank's pieces of the sharded checkpoint ``path`` into the live
        state (resharded by DCP onto the current world); returns the payload it filled."""
        if self._sharded is None:
            raise RuntimeError("no sharded checkpointer")
        if not path.is_dir():
            raise ckpt.CheckpointError(
                f"checkpoint {path} is a single-file (replicated) checkpoint, but the model is "
                "sharded (FSDP2); resume it with the replicated model, or start a new directory"
            )
        payload = self.payload()
        payload.pop("config", None)  # saved for the operator; not read back
        sharded.load_into(path, payload, group=self._sharded.group)
        self.state.load_state_dict(payload)
        payload["jit"] = sharded_jit.written_just_in_time(path)  # for the resume line
        return payload

    def _restore(self, state: Mapping[str, Any]) -> int:
        """Continue from ``state``, a peer's payload (``TrainingState.peer_snapshot``, on this
        rank's device), or for a sharded state this rank's own shards as a heal in place gathered
        them (``ShardedState.local_state``): no file, no collective. Returns the step."""
        if self.state.sharded is not None:
            self.state.load_local_state(state)
        else:
            self.state.load_state_dict(state)
        self.resumed_from = self.step
        self._last_saved_step = None
        self.last_path = None
        if self.env.is_rank0 and self.directory is not None and Path(self.directory).is_dir():
            # Every member's writes ended before it answered the heal round: what is left behind
            # is a dead writer's (as at a start-up, where rank 0 does the same).
            ckpt.remove_stale_temp_files(self.directory)
            ckpt.remove_stale_claims(self.directory)
        self._setup_jit(self._jit_wanted())
        return self.step

    def _jit_wanted(self) -> bool:
        """This rank's view of whether to save just in time (rank 0's view is the one used)."""
        wanted = (
            self.config.jit_save if self.config.jit_save is not None else self.settings.jit_save
        )
        if not wanted:
            if self.env.is_rank0:
                log.info(
                    "just-in-time checkpoints are off (jit_save=False or ELASTIC_TRAINER_JIT_SAVE=0)"
                )
            return False
        if self.directory is None:
            return False
        if any(hasattr(obj, "consolidate_state_dict") for obj in self.state.objects.values()):
            if self.env.is_rank0:
                log.warning(
                    "just-in-time checkpoints are off with a sharded optimizer (ZeroRedundancyOptimizer): its "
                    "state is spread over the ranks and its step runs collectives, so no single surviving rank "
                    "holds it; a failure resumes from the last periodic checkpoint"
                )
            return False
        return True

    def _choose(self) -> tuple[str, str | None]:
        """Rank 0: which checkpoint every rank loads, as ``(kind, value)`` for the broadcast."""
        return ckpt.choose_resume(self.directory or ".", self.fingerprint_fields)

    def boundary(self) -> None:
        """A step ended (stall detection of the just-in-time save)."""
        self.state.guard.boundary()

    # -- saving --------------------------------------------------------------------------------------
    def save(self, *, final: bool = False) -> str | None:
        """Checkpoint the current step (every rank calls it at the same step).

        Periodic saves (``final=False``) cost the other ranks nothing: rank 0 stages the state
        into reused host buffers and writes it on a background thread (``async_write``, the
        default) or writes it at once; a failure is reported to every rank by the next step's
        control (:attr:`write_failed`). ``final`` (the end, a graceful stop) is collective: rank 0
        writes synchronously, and every rank learns the outcome from rank 0, which is also the
        barrier that keeps the others from exiting before the file is in place. Returns the path
        (``None`` without a directory; on rank 0 only).

        Raises:
            CheckpointWriteError: a final write failed (a full disk, ...); earlier checkpoints stand.
        """
        env = self.env
        if self.directory is None or self._last_saved_step == self.step:
            return self.last_path
        started = time.monotonic()
        if self._sharded is not None:
            return self._save_sharded(self._sharded, final=final, started=started)
        for obj in self.state.objects.values():
            consolidate = getattr(obj, "consolidate_state_dict", None)
            if consolidate is not None:
                consolidate(to=0)  # a sharded optimizer gathers its state on rank 0
        if not final:
            self._last_saved_step = self.step
            if env.is_rank0 and self._failure is None:
                try:
                    with self._jit.busy():
                        self._committed_path = self.last_path
                        self.last_path = self._write(
                            sync=not self.config.async_write, started=started
                        )
                except ckpt.CheckpointError as exc:
                    self._failure = exc  # every rank raises it at the next step's control
            return self.last_path
        outcome: list[Any] = [("ok", None)]
        if env.is_rank0:
            try:
                outcome = [("ok", self._write(sync=True, started=started))]
            except ckpt.CheckpointError as exc:
                outcome = [("error", str(exc))]
        if env.world_size > 1:
            dist.broadcast_object_list(outcome, src=0)
        kind, value = outcome[0]
        if kind == "error":
            raise ckpt.CheckpointWriteError(value)
        self._last_saved_step = self.step
        self.last_path = value
        return value

    def _save_sharded(
        self, writer: sharded.ShardedCheckpointer, *, final: bool, started: float
    ) -> str | None:
        """:meth:`save` of a sharded state: collective, every rank writes its shards, rank 0
        commits. A periodic write's failure (on any rank) reaches every rank through the next
        step's control; a final one's through rank 0's outcome on the checkpoint group."""
        step, epoch = self.step, self.state.current_epoch
        path = str(ckpt.sharded_path(writer.directory, step))
        if not final:
            self._last_saved_step = step
            if self._failure is not None:
                return self.last_path
            payload: dict[str, Any] = {}
            try:
                # All of the save's part on this thread is no stall: the state dict (DCP's
                # state-dict API), the wait for the previous write, the staging copy, and a
                # synchronous write's planning collectives.
                with self._jit.busy():
                    payload = self.payload()
                    self._committed_path = self.last_path
                    writer.save(payload, step=step, epoch=epoch, sync=not self.config.async_write)
                    self.last_path = path
            except ckpt.CheckpointFencedError as exc:
                log.warning("%s", exc)
                self._last_saved_step = None
                return self.last_path
            except ckpt.CheckpointError as exc:
                self._failure = exc  # every rank raises it at the next step's control
                return self.last_path
            self.observer.on_checkpoint_saved(
                step=step,
                duration_s=time.monotonic() - started,
                nbytes=sharded.local_nbytes(payload),
            )
            return path
        payload = self.payload()
        outcome: list[Any] = [("ok", path)]
        try:
            self._sync_writing = True
            writer.save(payload, step=step, epoch=epoch, sync=True)
        except ckpt.CheckpointFencedError as exc:
            log.warning("%s", exc)
            outcome = [("fenced", self.last_path)]
        except ckpt.CheckpointError as exc:
            outcome = [("error", str(exc))]
        finally:
            self._sync_writing = False
        if self.env.world_size > 1:
            dist.broadcast_object_list(outcome, src=0, group=writer.group)
        kind, value = outcome[0]
        if kind == "error":
            raise ckpt.CheckpointWriteError(value)
        if kind == "ok":
            self._last_saved_step = step
            self.observer.on_checkpoint_saved(
                step=step,
                duration_s=time.monotonic() - started,
                nbytes=sharded.local_nbytes(payload),
            )
        self.last_path = value
        return value

    def _background_write_refused(self, exc: ckpt.CheckpointFencedError) -> None:
        """(Writer thread) the commit fence refused the write just submitted: nothing new is on
        disk, so the last checkpoint is still the previous one, and the step may be saved again."""
        self.last_path = self._committed_path
        self._last_saved_step = None

    @property
    def writing(self) -> bool:
        """A checkpoint is being written (in the background, or on the calling thread)."""
        return self._sync_writing or self._writer.busy

    @property
    def write_failed(self) -> bool:
        """(Rank 0) a periodic write failed; the next control tells every rank. Never waits."""
        if self._failure is None and self._writer.failed:
            try:
                self._writer.wait(0)
            except ckpt.CheckpointError as exc:
                self._failure = exc
        return self._failure is not None

    def raise_write_failure(self) -> None:
        """Every rank, after a control said rank 0's checkpoint write failed: raise it (rank 0
        raises its own error, the others say where to look).

        Raises:
            CheckpointWriteError: always.
        """
        if self._failure is not None:
            raise ckpt.CheckpointWriteError(str(self._failure)) from self._failure
        raise ckpt.CheckpointWriteError(
            "rank 0 could not write a checkpoint (its log says why); earlier checkpoints stand"
        )

    def payload(self, state: dict[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint holds: ``state`` (default the live state's payload; the caller copies
        or writes its tensors at once) with the file's format, the job's fingerprint and config."""
        data: dict[str, Any] = {"format": ckpt.FORMAT}
        data.update(self.state.state_dict() if state is None else state)
        data.update(
            {
                "fingerprint": ckpt.job_fingerprint(self.fingerprint_fields),
                "config": self.run_config,
            }
        )
        return data

    def _write(self, *, sync: bool, started: float) -> str | None:
        """Write (``sync``) or stage and submit the checkpoint of the current step; its path (the
        previous one's when the fence refused the commit)."""
        directory = self.directory
        if directory is None:
            raise RuntimeError("checkpointing needs a directory")
        payload = self.payload()
        step, epoch, world_size = self.step, self.state.current_epoch, self.env.world_size
        path = str(ckpt.checkpoint_path(directory, step))
        claim: ckpt.StepClaim | None = None
        if self._jit.enabled:
            # One writer per step: a survivor may be writing this step just in time (the group is
            # failing); it will finish it.
            try:
                claim = ckpt.try_claim(directory, step, rank=self.env.rank, kind="periodic")
            except OSError as exc:
                raise ckpt.CheckpointWriteError(
                    f"could not write the checkpoint of step {step} to {directory}: {exc.strerror or exc}"
                ) from exc
            if claim is None:
                log.warning(
                    "step %d is being checkpointed by %s; not writing it again",
                    step,
                    ckpt.read_claim(directory, step) or "another writer",
                )
                return path

        def save(data: dict[str, Any]) -> ckpt.CheckpointInfo:
            try:
                return ckpt.save_checkpoint(
                    directory,
                    data,
                    step=step,
                    epoch=epoch,
                    world_size=world_size,
                    fingerprint_fields=self.fingerprint_fields,
                    keep_last=self.config.keep_last,
                    fence=self._fence,
                )
            finally:
                if claim is not None:
                    claim.release()

        try:
            if sync:
                self._sync_writing = True
                try:
                    self._writer.wait(self._remaining_s())
                    nbytes = save(payload).manifest.nbytes
                except ckpt.CheckpointFencedError as exc:
                    log.warning("%s", exc)
                    self._last_saved_step = None  # not saved: the step may be saved again
                    return self.last_path
                finally:
                    self._sync_writing = False
            else:
                # On this thread: the next step changes the tensors. Into reused (pinned) buffers;
                # on CUDA the copies are queued, and the writer waits for them, not this thread.
                staged = self._staging.stage(payload)
                nbytes = staged.nbytes

                def write_staged() -> ckpt.CheckpointInfo:
                    staged.ready()
                    return save(staged.payload)

                self._writer.submit(write_staged)
        except BaseException:
            if claim is not None:
                claim.release()
            raise
        self.observer.on_checkpoint_saved(
            step=step, duration_s=time.monotonic() - started, nbytes=nbytes
        )
        return path

    def _remaining_s(self) -> float | None:
        deadline = self._stop_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    # -- the just-in-time save -------------------------------------------------------------------------
    def _setup_jit(self, enabled: bool) -> None:
        """(The training thread, after a load or restore) the just-in-time save of this attempt."""
        self._training_thread = threading.get_ident()
        self._shard_saver = None
        copies = self.state.copies
        if enabled and self._sharded is not None and self.state.sharded is not None:
            if copies is not None and copies.mode == "ring":
                self.state.sharded.checkpoint_names()  # on this thread: a save may run on another
                self._shard_saver = sharded_jit.ShardedJit(
                    self._sharded, self.state.sharded, copies, extras=self._part_entries
                )
            elif (
                (copies is None or copies.mode == "off")
                and self.env.world_size > 1
                and self.env.is_rank0
            ):
                log.info(
                    "just-in-time checkpoints of sharded state hold a rank's shards only while it "
                    "lives: the neighbour copy is off (shard_copy every=0, "
                    "ELASTIC_TRAINER_SHARD_COPY_EVERY=0) or not kept for this mesh (HSDP), so "
                    "after a worker's death the job "
                    "resumes from the newest periodic checkpoint"
                )
        self._jit = JitCheckpointer(
            guard=self.state.guard,
            directory=self.directory,
            rank=self.env.rank,
            step=lambda: self.step,
            payload=self._jit_payload,
            write=self._jit_write,
            drain=self._drain,
            stop_deadline=self._stop_deadline,
            writing=self._writing_step,
            may_save=self._jit_may_save,
            enabled=enabled,
            exclusive=self._sharded is None,  # sharded: every rank writes its own shards
        )
        self.state.track_buffers(enabled)

    def arm(self) -> None:
        """Training starts: the state now is a completed step (every rank holds the same buffers)."""
        self.state.arm()
        self._jit.arm()

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """Around work that is no stall although no step boundary passes (a checkpoint write)."""
        return self._jit.busy()

    def stand_down(self) -> None:
        """The ranks agreed to stop (or training ended): the graceful path owns the exit."""
        self._jit.stand_down()

    def on_signal(self, signum: int) -> None:
        """A stop signal arrived, maybe while the training thread is blocked in a collective."""
        self._jit.on_signal(signum)

    def after_failure(self, exc: BaseException) -> None:
        """The training loop raised: save the last completed step just in time (bounded), and
        make sure the process ends soon after (:data:`TEARDOWN_S`)."""
        if not self._jit.enabled:
            return
        # Save, then let the exception end the process quickly: torchrun restarts the group
        # once all its local workers are gone. Never hang on the way.
        self._deadline = ExitTimer(
            SAVE_TIMEOUT_S + TEARDOWN_S, 1, "saving and stopping after a failure"
        )
        self._jit.after_failure(exc)

    def save_just_in_time(self, reason: str, *, deadline: float) -> JitOutcome:
        """Save the last completed step now, from any thread (what a failure or a stalled stop
        does; idempotent)."""
        return self._jit.save(reason, deadline=deadline)

    def _writing_step(self) -> int | None:
        """The step of this process's periodic checkpoint write in flight (``None``: none)."""
        if self._sync_writing or self._writer.busy:
            return self._last_saved_step if self._last_saved_step is not None else self.step
        return None

    def _jit_may_save(self) -> str | None:
        """Why the calling thread must not save just in time (``None``: it may). Sharded state is
        read live only on the training thread: FSDP2 swaps a module's parameters between sharded
        and unsharded ones (and frees the unsharded storage) around forward and backward, so a
        state dict read on another thread while that thread runs breaks both. Another thread
        saves the neighbour copy's staged shards instead, or nothing."""
        if (
            self._sharded is None
            or self._shard_saver is not None
            or threading.get_ident() == self._training_thread
        ):
            return None
        return (
            "this rank's sharded (FSDP2) state is live on the training thread, which may still "
            "be running, and there is no staged copy of it (the neighbour copy is off)"
        )

    def _jit_payload(self) -> dict[str, Any]:
        """(Holding the guard) a host copy of the state after the last completed step (none with
        the neighbour copy: the shards are written from the copies it staged)."""
        if self._shard_saver is not None:
            return {}
        return self.payload(self.state.snapshot())

    def _jit_write(self, step: int, payload: dict[str, Any]) -> str:
        if self.directory is None:
            raise RuntimeError("just-in-time checkpointing needs a directory")
        if self._shard_saver is not None:
            return self._write_held_shards(step)
        if self._sharded is not None:
            # Each rank's own shards, no collective; the rank completing the set commits it.
            committed = self._sharded.save_own(payload, step=step, epoch=int(payload["epoch"]))
            if committed is not None:
                return str(committed.path)
            return (
                f"{sharded.jit_path(self.directory, step, self._sharded.token)} (this rank's "
                "shards; the checkpoint counts once every rank's are in)"
            )
        info = ckpt.save_checkpoint(
            self.directory,
            payload,
            step=step,
            epoch=int(payload["epoch"]),
            world_size=self.env.world_size,
            fingerprint_fields=self.fingerprint_fields,
            keep_last=None,
            jit=True,
            fence=self._fence,
        )
        return str(info.path)

    def _write_held_shards(self, step: int) -> str:
        """Every shard this rank holds (its own, the neighbour copy it received) as parts of a
        just-in-time checkpoint: of ``step``, or of the step before it where the dead rank's last
        copy was cut (``sharded_jit.ShardedJit``). The live state stands in for this rank's own
        shard on the training thread only; on another thread (a stalled stop, the healer's stop
        watch) the copy is stopped first, so that the training thread stages nothing new while
        the staged copies are written."""
        saver = self._shard_saver
        if saver is None:
            raise RuntimeError("no neighbour copy to write from")
        live = threading.get_ident() == self._training_thread
        if not live:
            saver.copies.stop()
        reason = f"the group failed after step {step}"
        outcome = saver.save(reason, deadline=time.monotonic() + SAVE_TIMEOUT_S, live=live)
        if outcome.path is not None and outcome.step == step:
            return outcome.path
        if outcome.path is not None:
            return f"{outcome.path} (step {outcome.step}: the lost rank's copy of {step} was cut)"
        return (
            f"{sharded.jit_path(self.directory or '.', step, saver.checkpointer.token)} (the shards "
            f"this rank holds: {outcome.detail}; the checkpoint counts once every rank's are in)"
        )

    def _part_entries(self, step: int, part: Mapping[str, Any]) -> dict[str, Any]:
        """What a checkpoint of ``step`` holds besides a part's shards and objects (as
        :meth:`payload` of a snapshot adds them)."""
        return {
            "format": ckpt.FORMAT,
            "rng": {"scheme": rng.STEP_SCHEME, "seed": self.state.seed},
            "step": step,
            "epoch": sharded_jit.part_epoch(part, self.state.epoch),
            "world_size": self.env.world_size,
            "fingerprint": ckpt.job_fingerprint(self.fingerprint_fields),
            "config": self.run_config,
            "jit": {"writer_rank": self.env.rank, "buffers": "own"},
        }

    def _drain(self, timeout: float) -> None:
        """Let this process's own background checkpoint write finish before it exits. A failed
        write is said in one line and not raised: the just-in-time save that drains it reads what
        reached the disk afterwards and writes the step itself when the write did not commit it."""
        try:
            self._writer.wait(timeout)
        except ckpt.CheckpointError as exc:
            log.warning("the background checkpoint write failed: %s", exc)

    # -- the end ----------------------------------------------------------------------------------------
    def close(self, grace_s: float) -> None:
        """Finish a background write (within the stop's remaining time, else ``grace_s``) and stand
        down; cancels the after-failure deadline once the caller's teardown is done."""
        try:
            if self._writer.busy:
                remaining = self._remaining_s()
                try:
                    self._writer.wait(remaining if remaining is not None else grace_s)
                except ckpt.CheckpointError as exc:
                    # One line: after a peer's death this is expected (the write's collectives
                    # failed with it), and the error already says which step and what stands.
                    log.error("the last background checkpoint write failed: %s", exc)
        finally:
            self._jit.stand_down()
            if self._deadline is not None:
                self._deadline.cancel()


def _size(path: str) -> int:
    """Bytes of a checkpoint: its file, or every file of its (sharded) directory."""
    if os.path.isdir(path):
        return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
    return os.path.getsize(path)


def resume_claim(state: TrainingState) -> str:
    """What the resume line may claim: bitwise exactness only for the objects restored."""
    missing = state.unrestored()
    scheme = (
        "random streams derive from (seed, rank, step), so every step from here is bitwise the step of a "
        "fault-free run with the same world-size history as far as it depends on this state (not on "
        "objects outside it, such as your own generators or per-rank counters)"
    )
    if not missing:
        return f"exact resume of the saved state ({', '.join(state.restored or [])}): {scheme}"
    return (
        f"NOT an exact resume: the checkpoint holds no {', '.join(repr(m) for m in missing)} (they start fresh); "
        f"restored: {', '.join(state.restored or []) or 'nothing'}"
    )
