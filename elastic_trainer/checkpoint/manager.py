"""The checkpoint manager: the training state to and from disk, and nothing else.

    state = TrainingState({"model": model, "optimizer": opt, "sampler": sampler}, env=env, seed=0)
    manager = CheckpointManager(CheckpointConfig(directory="/ckpt", every=100), env=env, state=state,
                                fingerprint={"model": model_signature(model.state_dict())})
    step = manager.load() or 0                 # collective: rank 0 chooses, every rank loads
    ...
    with state.update(step + 1):               # the optimizer step, scheduler, sampler advance
        optimizer.step()
    manager.save(step + 1)                     # every step: writes when due (every 100 here)
    ...
    manager.save(step, final=True)             # collective: the end, or a graceful stop
    manager.close(grace_s=30)                  # waits for a background write

What is saved is the :class:`~elastic_trainer.state.training_state.TrainingState`'s; this object
decides when (every ``every`` steps, and the final save), where (the directory, the file format,
the claims and the commit fence) and which file a start resumes from (load, fallback). A loop
talks to it through ``load``, ``save``, ``close``, ``last_path``, the write-failure flag its
control carries (``write_failed``, ``raise_write_failure``) and ``just_in_time``, the
just-in-time save's triggers (:class:`~elastic_trainer.checkpoint.jit.JustInTime`: a
surviving rank saving the last completed step when the group fails).

It owns the resume choice (rank 0 picks the newest good checkpoint of this job, broadcasts it,
every rank loads it with a ``map_location`` onto its own device and ``weights_only=True``), and
periodic and final saves (atomic files, one writer per step through claims, optionally on a
background thread). It reads its :class:`~elastic_trainer.checkpoint.config.CheckpointConfig`
once. The files are those of :mod:`elastic_trainer.checkpoint.files`:
``torch.load(path, weights_only=True)["model"]`` is a plain state_dict, and ``elastic-trainer
checkpoint list|verify|inspect`` reads them.

A sharded state (``TrainingState.sharded``: an FSDP2 model) is written in the sharded format of
:mod:`elastic_trainer.checkpoint.sharded` instead: every save is collective, every rank writes its
own shards (asynchronously by default, through DCP on the checkpoint's own gloo group), rank 0
commits; a load reads each rank's pieces, resharded onto the current world. That choice is the
state's, made once; the manager only follows it (``docs/design/sharded.md``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint import sharded, sharded_jit
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.checkpoint.jit import JustInTime
from elastic_trainer.checkpoint.staging import StagingBuffers
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.observer import NullObserver, TrainingObserver
from elastic_trainer.runtime.settings import WorkerSettings
from elastic_trainer.state.restore_plan import RESTORE, resume_sharded
from elastic_trainer.state.training_state import Stateful, TrainingState

# How long the commit fence may wait on etcd (milliseconds when it is up) before a periodic save
# that comes due meanwhile is skipped instead of waited for on the training thread.
CONFIRM_PATIENCE_S = 1.0

log = logging.getLogger(__name__)


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
        fence: ckpt.CommitFence | None = None,
    ) -> None:
        if (state is None) == (states is None):
            raise ValueError("CheckpointManager takes either state= or states=")
        self._config, self._env = config, env
        self._fence = self._confirming_fence(fence) if fence is not None else None
        self._confirming_since: float | None = None  # the fence asks etcd since (or None)
        self._fingerprint = dict(fingerprint)
        self.state = (
            state
            if state is not None
            else TrainingState(
                states or {}, env=env, model=model, seed=self._fingerprint.get("seed")
            )
        )
        """What is saved and restored."""
        settings = settings if settings is not None else WorkerSettings.from_environ()
        self._observer: TrainingObserver = observer if observer is not None else NullObserver()
        self._run_config = dict(run_config or {})
        self.last_path: str | None = None
        """The newest checkpoint this process wrote or resumed from (rank 0's path)."""
        self._resumed_from: int | None = None
        self._committed_path: str | None = None  # the last path before a background write in flight
        # Refusals of background writes by the commit fence: one can come (on the writer's thread)
        # before the save that submitted the write has set ``last_path``.
        self._refusals = 0
        self._refusal_lock = threading.Lock()
        self._last_saved_step: int | None = None
        self._sync_writing = False
        self._failure: ckpt.CheckpointError | None = None
        self._sharded: sharded.ShardedCheckpointer | None = None
        if self.state.sharded is not None and config.directory is not None:
            # Collective (the checkpoint's own process group): every rank builds its manager here.
            self._sharded = sharded.ShardedCheckpointer.for_job(
                config, env=env, fingerprint_fields=self._fingerprint, fence=fence
            )
        # Rank 0's writer of single files, or this rank's writer of its shards.
        self._writer = (
            self._sharded.writer if self._sharded is not None else ckpt.AsyncCheckpointWriter()
        )
        self._writer.on_refused = self._background_write_refused
        self._staging = StagingBuffers(env.device)
        self.just_in_time = self._just_in_time(
            config.jit_save if config.jit_save is not None else settings.jit_save
        )
        """The just-in-time save's triggers (set up by :meth:`load`)."""

    @property
    def directory(self) -> str | None:
        """Where the checkpoints go (``None``: nowhere)."""
        return self._config.directory

    def _just_in_time(self, switch: bool) -> JustInTime:
        """This manager's just-in-time save (``switch``: whether the job wants it), writing
        through the manager's files and payload."""
        return JustInTime(
            state=self.state,
            env=self._env,
            directory=self._config.directory,
            switch=switch,
            sharded=self._sharded,
            writer=self._writer,
            payload=self._payload,
            write_file=lambda payload, step, epoch: str(
                self._save_file(payload, step=step, epoch=epoch, jit=True).path
            ),
            writing=self._writing_step,
        )

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
        (``state.restore_plan.resume_sharded``).

        Raises:
            CheckpointMismatchError: the directory holds another job's checkpoints.
            CheckpointError: the directory cannot be used.
        """
        if initial is None:
            return self._load_newest()
        if RESTORE in initial:
            resume_sharded(
                initial, restore=self._restore, load=self._load_newest, rank=self._env.rank
            )
            return self._resumed_from
        return self._restore(initial)

    def _load_newest(self) -> int | None:
        """:meth:`load` of the newest good checkpoint."""
        value, jit = self._choose()
        if value is not None:
            self._load_file(value)
        elif self._env.is_rank0 and self._config.directory is None:
            log.warning(
                "no checkpoint_dir: this job is not fault tolerant; a restart starts again from step 0 "
                "(give a checkpoint directory that every node shares, e.g. --checkpoint-dir)"
            )
        elif self._env.is_rank0:
            log.info("starting from scratch (no usable checkpoint in %s)", self._config.directory)
        self.just_in_time.setup(jit)
        return self._resumed_from

    def _choose(self) -> tuple[str | None, bool]:
        """Collective: rank 0's choice of the checkpoint every rank loads (``None``: none), and
        whether this job saves just in time."""
        directory = self._config.directory
        decision: list[Any] = [None, self.just_in_time.wanted()]
        if directory is not None and self._env.is_rank0:
            # Before the choice removes them: a just-in-time set of shards that never completed.
            lost = (
                sharded_jit.describe_incomplete(directory, ckpt.newest_step(directory))
                if self._sharded is not None
                else None
            )
            decision[0] = ckpt.choose_resume(directory, self._fingerprint)
            if lost is not None:
                log.warning("%s", lost)
        if self._env.world_size > 1:
            dist.broadcast_object_list(decision, src=0)
        return ckpt.chosen_path(decision[0]), bool(decision[1])

    def _load_file(self, value: str) -> None:
        """Collective for a sharded state: load the checkpoint ``value`` into the live state."""
        started = time.monotonic()
        if self._sharded is not None:
            state = self._load_sharded(Path(value), self._sharded)
        elif os.path.isdir(value):
            raise ckpt.CheckpointError(
                f"checkpoint {value} is sharded (FSDP2), but the model is not sharded; resume "
                "it with the sharded model, or turn it into one file with `elastic-trainer "
                "checkpoint export`"
            )
        else:
            state = ckpt.load_checkpoint(value, self._env.device)
            self.state.load_state_dict(state)
        step = self.state.step
        self._observer.on_checkpoint_loaded(
            step=step, duration_s=time.monotonic() - started, nbytes=_size(value)
        )
        self._resumed_from = self._last_saved_step = step
        self.last_path = value
        if self._env.is_rank0:
            log.info(
                "resumed from %s%s (step %d, epoch %d, saved by %d ranks, now %d); %s",
                value,
                " (a just-in-time checkpoint)" if state.get("jit") else "",
                step,
                self.state.epoch,
                state["world_size"],
                self._env.world_size,
                resume_claim(self.state),
            )

    def _load_sharded(
        self, path: Path, checkpointer: sharded.ShardedCheckpointer
    ) -> dict[str, Any]:
        """Collective: read this rank's pieces of the sharded checkpoint ``path`` into the live
        state (resharded by DCP onto the current world); returns the payload it filled."""
        if not path.is_dir():
            raise ckpt.CheckpointError(
                f"checkpoint {path} is a single-file (replicated) checkpoint, but the model is "
                "sharded (FSDP2); resume it with the replicated model, or start a new directory"
            )
        payload = self._payload()
        payload.pop("config", None)  # saved for the operator; not read back
        sharded.load_into(path, payload, group=checkpointer.group)
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
        self._resumed_from = self.state.step
        self._last_saved_step = None
        self.last_path = None
        directory = self._config.directory
        if self._env.is_rank0 and directory is not None and Path(directory).is_dir():
            # Every member's writes ended before it answered the heal round: what is left behind
            # is a dead writer's (as at a start-up, where rank 0 does the same).
            ckpt.remove_stale_temp_files(directory)
            ckpt.remove_stale_claims(directory)
        self.just_in_time.setup(self.just_in_time.wanted())
        return self.state.step

    # -- saving --------------------------------------------------------------------------------------
    def save(self, step: int, *, final: bool = False) -> str | None:
        """After ``step`` (every rank calls it after every step): checkpoint it when a periodic
        checkpoint is due (every ``config.every`` steps) or ``final``. Returns the newest
        checkpoint's path (``None`` without a directory or before the first; rank 0's).

        Periodic saves cost the other ranks nothing: rank 0 stages the state into reused host
        buffers and writes it on a background thread (``async_write``, the default) or writes it
        at once; a failure is reported to every rank by the next step's control
        (:attr:`write_failed`). A sharded state's periodic saves are collective (every rank
        writes its shards). ``final`` (the end, a graceful stop) is collective: written at once,
        and every rank learns the outcome from rank 0, which is also the barrier that keeps the
        others from exiting before the file is in place.

        Raises:
            CheckpointWriteError: a final write failed (a full disk, ...); earlier checkpoints stand.
            ValueError: ``step`` is not the state's.
        """
        if step != self.state.step:
            raise ValueError(f"save({step}): the state is at step {self.state.step}")
        due = final or step % self._config.every == 0
        if not due or self._config.directory is None or self._last_saved_step == step:
            return self.last_path
        started = time.monotonic()
        if self._sharded is None:
            for obj in self.state.objects.values():
                consolidate = getattr(obj, "consolidate_state_dict", None)
                if consolidate is not None:
                    consolidate(to=0)  # a sharded optimizer gathers its state on rank 0
        if final:
            return self._save_final(step, started)
        since = self._confirming_since
        if (
            self._sharded is None
            and since is not None
            and time.monotonic() - since >= CONFIRM_PATIENCE_S
            and self._writer.busy
        ):
            # The previous write has waited on etcd to confirm its commit for longer than etcd
            # takes when it is up (an outage): this one is skipped rather than waited for on
            # the training thread; the next due step saves.
            log.warning(
                "checkpoint of step %d skipped: the previous one still waits for etcd to confirm "
                "its commit", step,
            )  # fmt: skip
            return self.last_path
        self._last_saved_step = step
        if self._failure is None and (self._sharded is not None or self._env.is_rank0):
            try:
                # All of the save's part on this thread is no stall: the state dict, the wait for
                # the previous write, the staging copy, a synchronous write.
                with self.just_in_time.busy():
                    self._committed_path, refusals = self.last_path, self._refusals
                    path = self._write(step, sync=not self._config.async_write, started=started)
                    with self._refusal_lock:  # the writer may have refused it already
                        if self._refusals == refusals:
                            self.last_path = path
            except ckpt.CheckpointError as exc:
                self._failure = exc  # every rank raises it at the next step's control
        return self.last_path

    def _save_final(self, step: int, started: float) -> str | None:
        """:meth:`save` of the final checkpoint: collective; rank 0 broadcasts the outcome (over
        the checkpoint's own group for a sharded state, which every rank writes)."""
        outcome: list[tuple[str, str | None]] = [("ok", None)]
        if self._sharded is not None or self._env.is_rank0:
            try:
                # (A single file's write says so itself, once it holds the step's claim.)
                self._sync_writing = self._sharded is not None
                outcome = [("ok", self._write(step, sync=True, started=started))]
            except ckpt.CheckpointError as exc:
                outcome = [("error", str(exc))]
            finally:
                self._sync_writing = False
        if self._env.world_size > 1:
            group = self._sharded.group if self._sharded is not None else None
            dist.broadcast_object_list(outcome, src=0, group=group)
        kind, value = outcome[0]
        if kind == "error":
            raise ckpt.CheckpointWriteError(value)
        self._last_saved_step = step
        self.last_path = value
        return value

    def _write(self, step: int, *, sync: bool, started: float) -> str | None:
        """Write (``sync``) or stage and submit the checkpoint of ``step``: a sharded state's
        shards, else one file; its path (the previous one's when the fence refused the commit)."""
        try:
            if self._sharded is not None:
                written: tuple[str, int] | None = self._write_shards(self._sharded, step, sync=sync)
            else:
                written = self._write_single(step, sync=sync)
        except ckpt.CheckpointFencedError as exc:
            log.warning("%s", exc)
            self._last_saved_step = None  # not saved: the step may be saved again
            return self.last_path
        if written is None:  # another writer has the step
            return str(ckpt.checkpoint_path(self._config.directory or ".", step))
        path, nbytes = written
        self._observer.on_checkpoint_saved(
            step=step, duration_s=time.monotonic() - started, nbytes=nbytes
        )
        return path

    def _write_shards(
        self, checkpointer: sharded.ShardedCheckpointer, step: int, *, sync: bool
    ) -> tuple[str, int]:
        """This rank's shards of ``step`` (collective); their path and this rank's bytes."""
        payload = self._payload()
        checkpointer.save(payload, step=step, epoch=self.state.current_epoch, sync=sync)
        return str(ckpt.sharded_path(checkpointer.directory, step)), sharded.local_nbytes(payload)

    def _write_single(self, step: int, *, sync: bool) -> tuple[str, int] | None:
        """(Rank 0) the state as one file; its path and bytes (``None``: another writer has the
        step, a survivor saving it just in time, and will finish it)."""
        directory = self._config.directory or "."
        payload = self._payload()
        epoch = self.state.current_epoch
        path = str(ckpt.checkpoint_path(directory, step))
        claim: ckpt.StepClaim | None = None
        if self.just_in_time.enabled:
            claim = self._claim(directory, step)
            if claim is None:
                return None
        try:
            if sync:
                self._sync_writing = True
                try:
                    self._writer.wait(self._remaining_s())
                    info = self._save_file(payload, step=step, epoch=epoch, jit=False, claim=claim)
                    return path, info.manifest.nbytes
                finally:
                    self._sync_writing = False
            # On this thread: the next step changes the tensors. Into reused (pinned) buffers; on
            # CUDA the copies are queued, and the writer waits for them, not this thread.
            staged = self._staging.stage(payload)

            def write_staged() -> ckpt.CheckpointInfo:
                staged.ready()
                return self._save_file(
                    staged.payload, step=step, epoch=epoch, jit=False, claim=claim
                )

            self._writer.submit(write_staged)
            return path, staged.nbytes
        except BaseException:
            if claim is not None:
                claim.release()
            raise

    def _claim(self, directory: str, step: int) -> ckpt.StepClaim | None:
        """One writer per step (while a survivor may save just in time): the claim of ``step``,
        or ``None`` (said in one line) when another writer holds it."""
        try:
            claim = ckpt.try_claim(directory, step, rank=self._env.rank, kind="periodic")
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
        return claim

    def _save_file(
        self,
        data: Mapping[str, Any],
        *,
        step: int,
        epoch: int,
        jit: bool,
        claim: ckpt.StepClaim | None = None,
    ) -> ckpt.CheckpointInfo:
        """``data`` as ``step``'s single-file checkpoint (just in time: prunes nothing, so that
        two writers never delete each other's files); releases ``claim`` when done."""
        try:
            return ckpt.save_checkpoint(
                self._config.directory or ".",
                data,
                step=step,
                epoch=epoch,
                world_size=self._env.world_size,
                fingerprint_fields=self._fingerprint,
                keep_last=None if jit else self._config.keep_last,
                jit=jit,
                fence=self._fence,
            )
        finally:
            if claim is not None:
                claim.release()

    def _payload(self, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint holds: ``state`` (default the live state's payload; the caller copies
        or writes its tensors at once) with the file's format, the job's fingerprint and config."""
        data: dict[str, Any] = {"format": ckpt.FORMAT}
        data.update(self.state.state_dict() if state is None else state)
        data.update(
            {"fingerprint": ckpt.job_fingerprint(self._fingerprint), "config": self._run_config}
        )
        return data

    def _confirming_fence(self, fence: ckpt.CommitFence) -> ckpt.CommitFence:
        """``fence``, flagging while it runs (it may wait seconds for etcd)."""

        def confirm() -> str | None:
            self._confirming_since = time.monotonic()
            try:
                return fence()
            finally:
                self._confirming_since = None

        return confirm

    def _background_write_refused(self, exc: ckpt.CheckpointFencedError) -> None:
        """(Writer thread) the commit fence refused the write just submitted: nothing new is on
        disk, so the last checkpoint is still the previous one, and the step may be saved again."""
        with self._refusal_lock:
            self._refusals += 1
            self.last_path = self._committed_path
            self._last_saved_step = None

    def _remaining_s(self) -> float | None:
        deadline = self.just_in_time.stop_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _writing_step(self) -> int | None:
        """The step of this process's periodic checkpoint write in flight (``None``: none)."""
        if self._sync_writing or self._writer.busy:
            return self._last_saved_step if self._last_saved_step is not None else self.state.step
        return None

    # -- a failed write, and the end ------------------------------------------------------------------
    @property
    def writing(self) -> bool:
        """A checkpoint is being written (in the background, or on the calling thread)."""
        return self._sync_writing or self._writer.busy

    @property
    def write_failed(self) -> bool:
        """(Rank 0) a periodic write failed: the flag the next step's control carries to every
        rank, which then calls :meth:`raise_write_failure`. Never waits."""
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

    def close(self, grace_s: float) -> None:
        """Finish a background write (within the stop's remaining time, else ``grace_s``) and stand
        down the just-in-time save; cancels its after-failure deadline once the caller's teardown
        is done."""
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
            self.just_in_time.close()


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
