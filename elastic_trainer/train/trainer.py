"""The training loop: DDP set up correctly, exact resume after any restart, graceful stop.

A job is described by a :class:`TrainingJob` (factories for model, dataset, optimizer, scheduler,
and a loss) and a :class:`~elastic_trainer.train.config.TrainerConfig`; ``Trainer(config, job).fit()``
runs it on every worker that torchrun starts::

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=demo \\
        --nnodes=1:2 --nproc-per-node=2 -m elastic_trainer.examples.synthetic_cnn \\
        --global-batch-size 64 --max-steps 200 --checkpoint-dir /shared/ckpt

What the runtime guarantees:

* Identical initial weights on every rank (seeded before the model factory runs); the model is on
  its device before DDP wraps it; optional SyncBatchNorm; ``nn.DataParallel`` is refused.
* A step's math does not depend on the world size: every step consumes ``global_batch_size``
  samples split over the ranks alive now, each rank scales its loss so that DDP's gradient average
  equals the mean over the global batch, and accumulates (``no_sync``) beyond ``micro_batch_size``.
* torchrun restarts every worker after any failure; they all load rank 0's newest good checkpoint
  (model, optimizer, scheduler, scaler, sampler cursor) and replay the same batches. Random numbers
  need no saved state: every step reseeds each rank's generators from ``(seed, rank, step)``
  (:func:`elastic_trainer.runtime.rng.seed_step`), so dropout and in-step augmentation replay too, even after
  a just-in-time save by a rank other than the dead one. With the same world-size history the result
  is bitwise the one of an uninterrupted run. At three or
  more ranks that also needs DDP's gradient buckets in the layout of a DDP past its first steps:
  a restarted trainer primes them once before its first step (:meth:`Trainer._prime_buckets`).
* SIGTERM (preemption, scale-down, a new node joining) finishes the step in progress on every
  rank (and at most one more: the stop flag rides on the per-step control allreduce, which is
  read one step later; with just-in-time saving exchanging module buffers on it, the update
  already waited for it, so it is read at once and the step in progress is the last), rank 0
  checkpoints the step they all stopped after, and the workers exit within the grace period.
* When the group fails instead (a worker died: collectives raise, or the agent SIGTERMs workers
  stuck in one), a surviving rank checkpoints the last completed step just in time, so at most
  one step is redone (``jit_save``, on by default; see :mod:`elastic_trainer.checkpoint.jit`).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import math
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint.jit import (
    SAVE_TIMEOUT_S,
    AuthoritativeBuffers,
    ExitTimer,
    JitCheckpointer,
    StateGuard,
    device_snapshot,
    flush_logs,
)
from elastic_trainer.runtime import distributed, failures, rng
from elastic_trainer.runtime.observer import NullObserver, TrainingObserver
from elastic_trainer.runtime.sample_log import SampleLog
from elastic_trainer.runtime.sampler import ElasticSampler, MicroBatchSampler, StepPlan
from elastic_trainer.runtime.signals import GracefulStop, SignalWakeup
from elastic_trainer.train.config import ENV_JIT_SAVE, ConfigError, TrainerConfig

log = logging.getLogger(__name__)

EXIT_STOPPED = 128 + 15
"""Exit code after a graceful stop: non-zero so that torchrun restarts (or ends) the group."""
TEARDOWN_S = 10.0
"""After a failure, the JIT save plus teardown (process group, writers) must end within
``SAVE_TIMEOUT_S + TEARDOWN_S``; past that the process exits (code 1) instead of hanging."""


class TrainerSetupError(ConfigError):
    """The job or config cannot run here; the message says what to change."""


@dataclass(kw_only=True, slots=True)
class TrainingJob:
    """What to train. Every factory runs on every rank, after the process group exists."""

    model: Callable[[], nn.Module]
    """Builds the plain model (not DataParallel/DDP-wrapped); called right after seeding."""
    dataset: Callable[[], Dataset[Any]]
    """Builds a map-style dataset with ``__len__``; items collate with the default collate."""
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    """Builds the optimizer from the model's parameters."""
    loss: Callable[[Any, Any], torch.Tensor]
    """``loss(model_output, target)`` -> mean loss over the micro-batch (as nn losses' default)."""
    scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None
    """Builds an LR scheduler, stepped once per optimizer step."""
    tokens_per_sample: int = 0
    """Reported to the observer (tokens/s); 0 for non-sequence data."""


@dataclass(frozen=True, slots=True)
class TrainResult:
    """How :meth:`Trainer.fit` ended."""

    step: int
    epoch: int
    loss: float | None
    """Mean loss over the global batch of the last step."""
    resumed_from: int | None
    """Step of the checkpoint this run started from."""
    stopped_by_signal: bool
    """A rank received SIGTERM/SIGINT; every rank stopped after the same step."""
    checkpoint: str | None
    """The last checkpoint rank 0 wrote (rank 0 only)."""

    @property
    def exit_code(self) -> int:
        return EXIT_STOPPED if self.stopped_by_signal else 0


def _refuse_data_parallel(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, (nn.DataParallel, DDP)):
            where = f" (at {name!r})" if name else ""
            raise TrainerSetupError(
                f"the model factory returned a {type(module).__name__}-wrapped module{where}: return the plain "
                "module; the runtime runs one process per device and wraps it in DistributedDataParallel itself "
                "(nn.DataParallel is single-process and not supported)"
            )


def _move(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _move(v, device) for k, v in batch.items()}
    return batch


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


@dataclass(slots=True)
class _StepControl:
    """A finished step whose control allreduce may still be in flight."""

    step: int
    plan: StepPlan
    control: torch.Tensor
    work: Any
    data_wait_s: float
    buffers_at: int | None = None
    """Where rank 0's module buffers start in ``control`` (just-in-time saving), if they ride on it."""
    duration_s: float = 0.0
    complete: bool = False
    """The allreduce has completed (the update waited for it): the step can be reported at once."""


class Trainer:
    """Runs a :class:`TrainingJob` under DDP on the current worker; see the module docstring.

    Args:
        config: runtime settings.
        job: the factories.
        observer: receives events; default: :func:`build_observer` (Prometheus metrics under `elastic-trainer run`).
        env: the worker's place in the job; default: read from torchrun's environment.
    """

    def __init__(
        self,
        config: TrainerConfig,
        job: TrainingJob,
        *,
        observer: TrainingObserver | None = None,
        env: distributed.DistEnv | None = None,
    ) -> None:
        self.config = config
        self.job = job
        # Metrics by default wherever the launcher collects them (ELASTIC_TRAINER_METRICS=1).
        self.observer: TrainingObserver = observer if observer is not None else build_observer()
        self.env = env
        self.step = 0
        self.resumed_from: int | None = None
        self._writer = ckpt.AsyncCheckpointWriter()
        self._last_checkpoint: str | None = None
        self._last_saved_step: int | None = None
        self._stop = GracefulStop(config.sigterm_grace_s)
        self._sample_log: SampleLog | None = None
        # Just-in-time saving (see elastic_trainer.checkpoint.jit): the guard is held around every
        # update; the checkpointer is built once the model exists and the ranks agreed to use it.
        self._guard = StateGuard()
        self._jit = JitCheckpointer(guard=self._guard, directory=None, rank=0, step=lambda: self.step,
                                    payload=dict, write=lambda step, payload: "", enabled=False)
        self._buffers: AuthoritativeBuffers | None = None
        self._kill_at: tuple[int, int, str] | None = None
        self._update_event: Any = None
        self._wakeup = SignalWakeup(self._on_stop_signal)

    # -- public --------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Train until ``epochs``/``max_steps`` are done or a stop signal arrives.

        Creates the process group unless one exists, and destroys what it created on every exit
        path. Rank 0 writes the final checkpoint.
        """
        env = self.env or distributed.read_env(backend=self.config.backend)
        self.env = env
        ensure_progress_logging(env.rank)
        owns_group = not dist.is_initialized()
        self._stop.install()
        self._wakeup.install()
        deadline: ExitTimer | None = None
        try:
            if owns_group:
                distributed.init_process_group(env, pg_timeout_s=self.config.pg_timeout_s)
            self._setup()
            self._resume()
            self.observer.on_start(world_size=env.world_size, restart_count=env.restart_count,
                                   total_steps=self.total_steps)
            try:
                return self._train()
            except Exception as exc:
                failures.note_step(exc, self.step + 1)  # the launcher's repeat check compares steps
                if self._jit.enabled:
                    # Save, then let the exception end the process quickly: torchrun restarts
                    # the group once all its local workers are gone. Never hang on the way.
                    deadline = ExitTimer(SAVE_TIMEOUT_S + TEARDOWN_S, 1, "saving and stopping after a failure")
                    self._jit.after_failure(exc)
                raise
        finally:
            try:
                self._finish_background_write()
            finally:
                self._jit.stand_down()
                self._wakeup.uninstall()
                self._stop.uninstall()
                if self._sample_log is not None:
                    self._sample_log.close()
                if owns_group:
                    distributed.destroy_process_group()
                if deadline is not None:
                    deadline.cancel()

    @property
    def total_steps(self) -> int:
        """Optimizer steps the job trains for in all: ``max_steps``, or ``epochs`` x steps per epoch
        (``ceil(dataset size / global_batch_size)``, the last step of an epoch takes what is left),
        whichever comes first. For LR schedules and progress; known once :meth:`fit` set up the data."""
        per_epoch = len(self.sampler)
        total = self.config.epochs * per_epoch
        return total if self.config.max_steps is None else min(total, self.config.max_steps)

    # -- setup ---------------------------------------------------------------------------------
    def _env(self) -> distributed.DistEnv:
        """The distributed environment :meth:`fit` read; an error if used before that."""
        if self.env is None:
            raise RuntimeError("trainer used before its distributed environment was read")
        return self.env

    def _setup(self) -> None:
        cfg, env = self.config, self._env()
        device = env.device
        if cfg.sync_batchnorm and device.type != "cuda":
            raise TrainerSetupError("sync_batchnorm: torch's SyncBatchNorm runs on CUDA devices only; this worker is on CPU")
        if cfg.mixed_precision == "fp16" and device.type != "cuda":
            raise TrainerSetupError("mixed_precision: fp16 (with a GradScaler) needs CUDA; use bf16 on CPU")

        self._kill_at = _parse_kill_at(os.environ.get(ENV_TEST_KILL_AT)) if env.restart_count == 0 else None
        rng.seed_all(cfg.seed)  # identical initial weights on every rank
        model = self.job.model()
        if not isinstance(model, nn.Module):
            raise TrainerSetupError(f"the model factory returned {type(model).__name__}, not an nn.Module")
        _refuse_data_parallel(model)
        if cfg.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(device)  # before DDP: DDP wraps the parameters where they are
        self.model = model
        self.signature = ckpt.model_signature(model.state_dict())

        ddp_kwargs: dict[str, Any] = {
            "bucket_cap_mb": cfg.ddp.bucket_cap_mb,
            "find_unused_parameters": cfg.ddp.find_unused_parameters,
            "gradient_as_bucket_view": cfg.ddp.gradient_as_bucket_view,
            "static_graph": cfg.ddp.static_graph,
        }
        # torch >= 2.13 renamed forward-time buffer broadcasting to ``forward_sync_buffers`` (buffers
        # are then always synced once at construction, which resume relies on anyway).
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
            ddp_kwargs["forward_sync_buffers"] = cfg.ddp.broadcast_buffers
        else:
            ddp_kwargs["broadcast_buffers"] = cfg.ddp.broadcast_buffers
        if device.type == "cuda":
            ddp_kwargs.update(device_ids=[device.index], output_device=device.index)
        self.ddp = DDP(model, **ddp_kwargs)
        self.observer.wrap_ddp(self.ddp)

        optimizer = self.job.optimizer(model.parameters())
        if cfg.zero_redundancy:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            if len(optimizer.param_groups) != 1:
                raise TrainerSetupError("zero_redundancy: the optimizer factory must build a single parameter group")
            # Rebuild the same optimizer sharded: its hyper-parameters are its ``defaults``, less
            # those its constructor does not take (AdamW keeps ``decoupled_weight_decay`` there).
            accepted = inspect.signature(type(optimizer).__init__).parameters
            defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(optimizer), **defaults)
        self.optimizer = optimizer
        self.scheduler = self.job.scheduler(optimizer) if self.job.scheduler is not None else None
        self.scaler = torch.amp.GradScaler("cuda") if cfg.mixed_precision == "fp16" else None
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.mixed_precision)

        self.dataset = self.job.dataset()
        try:
            dataset_size = len(self.dataset)  # type: ignore[arg-type]
        except TypeError:
            raise TrainerSetupError(
                f"the dataset factory returned a {type(self.dataset).__name__} without __len__: the elastic sampler "
                "needs a map-style dataset (indexable, with a length)"
            ) from None
        if dataset_size == 0:
            raise TrainerSetupError("the dataset factory returned an empty dataset")
        self.sampler = ElasticSampler(
            dataset_size,
            cfg.global_batch_size,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
            micro_batch_size=cfg.micro_batch_size,
        )
        self.fingerprint_fields = {
            "model": self.signature,
            "dataset_size": self.sampler.dataset_size,
            "seed": cfg.seed,
            "shuffle": cfg.shuffle,
        }
        # Training randomness (dropout, augmentation) differs per rank, reproducibly.
        rng.seed_all(rng.derive_seed(cfg.seed, env.rank, 0))

    # -- resume ----------------------------------------------------------------------------------
    def _resume(self) -> None:
        cfg, env = self.config, self._env()
        # Rank 0 decides for all: which checkpoint to load, and whether to save just in time (JIT
        # widens the per-step control allreduce: every rank must agree, whatever its env says).
        decision: list[Any] = [None, self._jit_wanted()]
        if cfg.checkpoint_dir is not None and env.is_rank0:
            decision[0] = self._choose_checkpoint()
        if env.world_size > 1:
            dist.broadcast_object_list(decision, src=0)
        kind, value = decision[0] or ("none", None)
        jit_enabled = bool(decision[1])
        if kind == "mismatch":
            raise ckpt.CheckpointMismatchError(value)
        if kind == "error":
            raise ckpt.CheckpointError(value)
        if kind == "load":
            if value is None:
                raise RuntimeError("rank 0 chose to load a checkpoint but sent no path")
            started = time.monotonic()
            state = ckpt.load_checkpoint(value, env.device)
            self._apply(state)
            nbytes = os.path.getsize(value)
            self.observer.on_checkpoint_loaded(step=self.step, duration_s=time.monotonic() - started, nbytes=nbytes)
            self.resumed_from = self.step
            self._last_saved_step = self.step
            self._last_checkpoint = value
            if env.is_rank0:
                log.info("resumed from %s%s (step %d, epoch %d, cursor %d, saved by %d ranks, now %d); exact resume: "
                         "random streams derive from (seed, rank, step), so every step from here is bitwise the "
                         "step of a fault-free run with the same world-size history",
                         value, " (a just-in-time checkpoint)" if state.get("jit") else "", self.step,
                         self.sampler.epoch, self.sampler.cursor, state["world_size"], env.world_size)
        elif env.is_rank0 and cfg.checkpoint_dir is None:
            log.warning("no checkpoint_dir: this job is not fault tolerant; a restart starts again from step 0 "
                        "(give a checkpoint directory that every node shares, e.g. --checkpoint-dir)")
        elif env.is_rank0:
            log.info("starting from scratch (no checkpoint in %s)", cfg.checkpoint_dir)
        self._setup_jit(jit_enabled)
        self._open_sample_log()

    # -- just-in-time saving -----------------------------------------------------------------------
    def _jit_wanted(self) -> bool:
        """This rank's view of whether to save just in time (rank 0's view is the one used)."""
        cfg, env = self.config, self._env()
        if not cfg.jit_save:
            if env.is_rank0:
                log.info("just-in-time checkpoints are off (jit_save=False or %s=0)", ENV_JIT_SAVE)
            return False
        if cfg.checkpoint_dir is None:
            return False
        if cfg.zero_redundancy:
            if env.is_rank0:
                log.warning("just-in-time checkpoints are off with zero_redundancy: the optimizer state is sharded "
                            "over the ranks and its step runs collectives, so no single surviving rank holds it; "
                            "a failure resumes from the last periodic checkpoint")
            return False
        return True

    def _setup_jit(self, enabled: bool) -> None:
        env, cfg = self._env(), self.config
        self._jit = JitCheckpointer(
            guard=self._guard, directory=cfg.checkpoint_dir, rank=env.rank, step=lambda: self.step,
            payload=self._jit_payload, write=self._jit_write, drain=self._jit_drain,
            stop_deadline=lambda: self._stop.deadline, enabled=enabled,
        )
        if enabled:
            self._buffers = AuthoritativeBuffers(self.model, rank=env.rank, world_size=env.world_size)
            if env.device.type == "cuda":
                self._update_event = torch.cuda.Event()

    def _on_stop_signal(self, signum: int) -> None:
        """Wakeup thread: a stop signal arrived, maybe while the main thread is blocked."""
        self._jit.on_signal(signum)

    def _after_update(self, control: _StepControl) -> None:
        """Inside the guard, right after an update: remember what the state of this step is."""
        if self._buffers is not None:
            at = control.buffers_at
            self._buffers.commit(None if at is None else control.control[at:])
        if self._update_event is not None:
            self._update_event.record()

    def _fault_point(self, point: str) -> None:
        """Test hook (``ELASTIC_TRAINER_TEST_KILL_AT``): SIGKILL this worker at an exact point of a step."""
        if self._kill_at is None or self.env is None:
            return
        rank, step, where = self._kill_at
        current = self.step + 1 if point == "before_control" else self.step
        if (rank, step, where) == (self.env.rank, current, point):
            log.warning("test hook %s: SIGKILLing this worker at %s of step %d", ENV_TEST_KILL_AT, point, step)
            flush_logs()
            os.kill(os.getpid(), signal.SIGKILL)

    def _jit_payload(self) -> dict[str, Any]:
        """(Holding the guard) a host copy of the state after the last completed step."""
        env = self._env()

        def build() -> dict[str, Any]:
            model_state = self.model.state_dict()
            source = "none"
            if self._buffers is not None:
                buffers, source = self._buffers.snapshot()
                model_state.update(buffers)
            payload = self._payload(model_state)
            payload["jit"] = {"writer_rank": env.rank, "buffers": source}
            return payload

        return device_snapshot(build, env.device, self._update_event)

    def _jit_write(self, step: int, payload: dict[str, Any]) -> str:
        cfg, env = self.config, self.env
        if env is None or cfg.checkpoint_dir is None:
            raise RuntimeError("checkpointing needs the distributed environment and a checkpoint_dir")
        info = ckpt.save_checkpoint(cfg.checkpoint_dir, payload, step=step, epoch=int(payload["epoch"]),
                                    world_size=env.world_size, fingerprint_fields=self.fingerprint_fields,
                                    keep_last=None, jit=True)
        return str(info.path)

    def _jit_drain(self, timeout: float) -> None:
        """Let this process's own background checkpoint write finish before it exits."""
        with contextlib.suppress(ckpt.CheckpointError):
            self._writer.wait(timeout)

    def _choose_checkpoint(self) -> tuple[str, str | None]:
        """Rank 0: which checkpoint every rank loads, as ``(kind, value)`` for the broadcast."""
        directory = Path(self.config.checkpoint_dir or ".")
        if directory.exists() and not directory.is_dir():
            return ("error", f"checkpoint_dir {directory} exists and is not a directory")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if not os.access(directory, os.W_OK | os.X_OK):
                raise PermissionError(f"{directory} is not writable")
            ckpt.remove_stale_temp_files(directory)
            ckpt.remove_stale_claims(directory)  # writers of the previous group are gone by now
            info = ckpt.find_latest(directory)
        except OSError as exc:
            return ("error", f"checkpoint_dir {directory} cannot be used: {exc.strerror or exc}")
        if info is not None:
            try:
                ckpt.check_fingerprint(info, self.fingerprint_fields)
            except ckpt.CheckpointMismatchError as exc:
                return ("mismatch", str(exc))  # another job's directory: touch nothing
        # With the job's own checkpoint chosen (or none usable), set the newer damaged ones aside.
        ckpt.quarantine_newer_than(directory, None if info is None else info.step)
        return ("none", None) if info is None else ("load", str(info.path))

    def _apply(self, state: dict[str, Any]) -> None:
        env = self._env()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])
        # No generator state to restore: the next step reseeds from (seed, rank, step) (rng.seed_step).
        rng.seed_step(self.config.seed, env.rank, self.step, env.device)

    def _open_sample_log(self) -> None:
        cfg, env = self.config, self._env()
        if cfg.record_samples_dir is None:
            return
        generation = [(uuid.uuid4().hex, time.time())]
        if env.world_size > 1:
            dist.broadcast_object_list(generation, src=0)
        self._sample_log = SampleLog(cfg.record_samples_dir, rank=env.rank)
        self._sample_log.start(generation=generation[0][0], started_unix=generation[0][1],
                               resumed_step=self.step, world_size=env.world_size, rank=env.rank)

    # -- the loop --------------------------------------------------------------------------------
    def _done(self) -> bool:
        cfg = self.config
        return (cfg.max_steps is not None and self.step >= cfg.max_steps) or self.sampler.epoch >= cfg.epochs

    def _train(self) -> TrainResult:
        cfg, env = self.config, self._env()
        self.ddp.train()
        self._loss: float | None = None
        self._window = (time.monotonic(), 0)
        pending: _StepControl | None = None
        priming_passes = self._priming_passes()
        if self._buffers is not None:
            self._buffers.capture(identical=True)  # every rank loaded (or seeded) the same state
        self._jit.arm()
        while not self._done():
            if self.sampler.epoch_done:
                with self._guard.update():
                    self.sampler.set_epoch(self.sampler.epoch + 1)
                continue
            # The loader gets its own generator: creating an iterator draws a seed from it, which
            # must not advance the global RNG (a resumed run creates its iterator at another point).
            loader_rng = torch.Generator().manual_seed(
                rng.derive_seed(cfg.seed, self.sampler.epoch, self.sampler.cursor, env.rank, env.world_size)
            )
            loader = DataLoader(
                self.dataset,
                batch_sampler=MicroBatchSampler(self.sampler, env.rank, env.world_size),
                num_workers=cfg.num_workers,
                pin_memory=env.device.type == "cuda",
                generator=loader_rng,
            )
            batches: Iterator[Any] = iter(loader)
            for plan in self.sampler.plans(env.rank, env.world_size):
                if self._done():
                    break
                if priming_passes:
                    batches = self._prime_buckets(batches, passes=priming_passes)
                    priming_passes = 0
                started = time.monotonic()
                control = self._train_step(plan, batches)
                self._update(plan, control)
                self._fault_point("after_update")
                control.duration_s = time.monotonic() - started
                self._guard.boundary()
                if self._sample_log is not None:
                    self._sample_log.done(step=self.step)
                # A step is reported (loss, stop flag) once its control allreduce is in. Usually it
                # overlaps the next step and is read then, when waiting costs nothing (the host never
                # blocks on the step it just launched). When JIT buffers ride on it, _update already
                # waited for it: it is read now, and a stop flag ends the run one step earlier.
                # Either way every rank reads the same flag after the same step.
                stop = self._finish_control(pending) if pending is not None else False
                if control.complete:
                    stop = self._finish_control(control) or stop
                    pending = None
                else:
                    pending = control
                if stop:
                    self._jit.stand_down()  # every rank agreed to stop: the graceful path owns the exit
                    if pending is not None:
                        self._finish_control(pending)
                        pending = None
                    log.warning("stopping after step %d (signal on %s)", self.step,
                                "this rank" if self._stop.requested else "another rank")
                    path = self._checkpoint(final=True)
                    return TrainResult(step=self.step, epoch=self.sampler.epoch, loss=self._loss,
                                       resumed_from=self.resumed_from, stopped_by_signal=True, checkpoint=path)
                if self.step % cfg.checkpoint_every == 0:
                    with self._jit.busy():
                        self._checkpoint(final=False)
            del batches, loader
        self._jit.stand_down()
        if pending is not None:
            self._finish_control(pending)
        path = self._checkpoint(final=True)
        if env.is_rank0:
            log.info("training finished at step %d (epoch %d), loss %s", self.step, self.sampler.epoch,
                     "n/a" if self._loss is None else f"{self._loss:.6f}")
        return TrainResult(step=self.step, epoch=self.sampler.epoch, loss=self._loss, resumed_from=self.resumed_from,
                           stopped_by_signal=False, checkpoint=path)

    # -- DDP bucket layout after a restart ------------------------------------------------------------
    def _priming_passes(self) -> int:
        """How many throw-away forward/backward passes make a resumed DDP reduce like an
        uninterrupted one (see :meth:`_prime_buckets`); 0 when nothing needs priming.

        DDP (torch 2.13) reduces a fresh instance's first iteration in its *initial* bucket layout
        (all parameters in one bucket, in parameter order, without ``find_unused_parameters``),
        records the order in which gradients become ready during the first backward that
        synchronises, and *rebuilds* its buckets in that order at the next forward (once; the
        reducer's ``should_rebuild_buckets``: ``(static_graph or not find_unused_parameters) and
        not has_rebuilt_bucket``). With ``static_graph`` the first iteration defers every
        allreduce to the end of the backward and records nothing, so the rebuild comes one
        iteration later. A different layout puts each gradient element at another offset of the
        flat buffer, and a ring allreduce over three or more ranks (gloo; NCCL rings) sums each
        chunk starting at another rank: the sum is then not bitwise the same. Two ranks are
        immune (``a + b == b + a``), one rank has nothing to reduce.

        With ``static_graph`` every start, fresh or resumed and at any world size, begins with at
        least one pass: DDP's first backward must then synchronise, and the first step's first
        micro-batch runs under ``no_sync`` whenever a rank accumulates (torch 2.13 fails its
        ``expect_autograd_hooks_`` assertion; pytorch/pytorch#143580). The uninterrupted run did
        that pass too, so a resume needs two for the rebuild.
        """
        cfg, env = self.config, self._env()
        if cfg.ddp.static_graph:
            return 1 if self.step == 0 or env.world_size == 1 else 2
        if self.step == 0 or env.world_size == 1:
            return 0  # a fresh start is what the uninterrupted run did too
        if cfg.ddp.find_unused_parameters:
            return 0  # the reducer never rebuilds its buckets: a fresh layout is the only layout
        return 1

    def _prime_buckets(self, batches: Iterator[Any], *, passes: int) -> Iterator[Any]:
        """After a restart, bring DDP's bucket layout to where an uninterrupted run has it.

        Runs ``passes`` forward/backward passes with gradient synchronisation on, on the first
        micro-batch of the step about to run (fetched where the step would fetch it, and handed
        back to it), so that the reducer records the gradient-ready order and rebuilds its buckets
        at the step's forward exactly as it did in the uninterrupted run after its first steps. The
        passes leave no trace: gradients are dropped, every module buffer (BatchNorm statistics)
        and every generator state they touched are restored, the optimizer, scheduler, scaler and
        sampler are not used. Costs one forward/backward/allreduce per restart (with ``static_graph``:
        two per restart and one at a fresh start).

        Bitwise equality with the uninterrupted run then holds for every DDP option the config
        offers, provided the gradient-ready order of a backward does not depend on the data
        (data-dependent control flow with ``find_unused_parameters`` and ``static_graph`` would
        make the uninterrupted run's own layout depend on its first batch).
        """
        env = self._env()
        device = env.device
        first = next(batches)
        inputs, target = _move(first, device)
        generators = rng.capture(device)
        saved = [(module, name, buffer, buffer.detach().clone())
                 for module in self.model.modules() for name, buffer in module._buffers.items() if buffer is not None]
        for _ in range(passes):
            (self._forward_loss(inputs, target).float() * 0.0).backward()
        # No step reports these allreduces. Observers written before on_priming existed lack it.
        on_priming = getattr(self.observer, "on_priming", None)
        if on_priming is not None:
            on_priming(backward_passes=passes)
        self.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for module, name, buffer, copy in saved:
                buffer.copy_(copy)
                module._buffers[name] = buffer  # in case the forward replaced the tensor
        rng.restore(generators, device)
        log.debug("primed DDP's buckets with %d pass(es) before step %d", passes, self.step + 1)
        return itertools.chain([first], batches)

    def _start_control(self, local_loss: torch.Tensor, plan: StepPlan, *, data_wait: float) -> _StepControl:
        """Start the step's one small allreduce (after its last forward, before its update): summed
        loss (for the global mean) and stop flag (and, with just-in-time saving, rank 0's module
        buffers of this step, which :meth:`_update` waits for)."""
        env = self._env()
        stop = torch.tensor(float(self._stop.requested), device=env.device)
        extra = self._buffers.capture() if self._buffers is not None else None
        if extra is None:
            control = torch.stack([local_loss, stop])
        else:
            # Just-in-time saving: rank 0's buffers of this step ride along (see jit_save).
            control = torch.cat([torch.stack([local_loss, stop]).double(), extra.to(env.device)])
        work = dist.all_reduce(control, async_op=True) if env.world_size > 1 else None
        return _StepControl(step=self.step + 1, plan=plan, control=control, work=work, data_wait_s=data_wait,
                            buffers_at=None if extra is None else 2)

    def _finish_control(self, pending: _StepControl) -> bool:
        """Wait for a step's control allreduce, report the step; True if any rank must stop.

        Every rank sees the same reduced flag after the same step, so they all stop together: at
        most one step after the one during which the signal arrived (none when the update waited
        for the allreduce: see :attr:`_StepControl.complete`).
        """
        cfg, env = self.config, self._env()
        if pending.work is not None:
            pending.work.wait()
        loss_sum, stop = pending.control[:2].tolist()
        plan = pending.plan
        self._loss = loss_sum / plan.global_samples
        lr = self.optimizer.param_groups[0]["lr"]
        self.observer.on_step(lr=lr if isinstance(lr, float) else None,  # a tensor lr would synchronise
                              step=pending.step, duration_s=pending.duration_s, data_wait_s=pending.data_wait_s,
                              samples=plan.samples, tokens=plan.samples * self.job.tokens_per_sample, loss=self._loss)
        window_start, window_samples = self._window
        window_samples += plan.global_samples
        if env.is_rank0 and pending.step % cfg.log_every == 0:
            now = time.monotonic()
            self._log_progress(self._loss, window_samples / max(now - window_start, 1e-9), pending.step)
            window_start, window_samples = now, 0
        self._window = (window_start, window_samples)
        return stop > 0

    def _forward_loss(self, inputs: Any, target: Any) -> torch.Tensor:
        """The DDP forward and the job's loss of one micro-batch (under autocast with mixed precision)."""
        device_type = self._env().device.type
        with torch.autocast(device_type, dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None):
            return self.job.loss(self.ddp(inputs), target)

    def _train_step(self, plan: StepPlan, batches: Iterator[Any]) -> _StepControl:
        """Forward and backward of one step (no update); returns its control allreduce, started
        after the last forward so that it runs while the last backward computes."""
        env = self._env()
        device = env.device
        # Every step's random numbers are a function of (seed, rank, step): exact resume needs no
        # generator state, not even the dead rank's (see elastic_trainer.runtime.rng).
        rng.seed_step(self.config.seed, env.rank, self.step, device)
        if self._sample_log is not None:
            # Written before the step can commit anywhere (no rank can finish its update before this
            # rank's backward joined the gradient allreduce), so a committed step always has every
            # rank's record, whoever saved it.
            self._sample_log.step(step=self.step + 1, epoch=plan.epoch, cursor=plan.cursor,
                                  world_size=env.world_size, rank=env.rank, indices=plan.indices)
        self.optimizer.zero_grad(set_to_none=True)
        # Each rank's loss is scaled by world_size / global_samples: DDP averages gradients over the
        # ranks, so the result is the gradient of the mean loss over the global batch, whatever
        # the number of ranks and however unevenly the samples are split.
        scale = env.world_size / plan.global_samples
        loss_sum = torch.zeros((), device=device, dtype=torch.float32)
        data_wait = 0.0
        last = len(plan.micro_batches) - 1
        control: _StepControl | None = None
        for i, micro in enumerate(plan.micro_batches):
            wait_start = time.monotonic()
            inputs, target = _move(next(batches), device)
            data_wait += time.monotonic() - wait_start
            sync = contextlib.nullcontext() if i == last else self.ddp.no_sync()
            with sync:
                loss = self._forward_loss(inputs, target)
                loss_sum += loss.detach().float() * micro.samples
                if i == last:
                    # Loss and buffers (BatchNorm statistics change in the forward only) are final:
                    # the control allreduce overlaps the backward, and precedes DDP's bucket
                    # allreduces on every rank alike.
                    self._fault_point("before_control")
                    control = self._start_control(loss_sum, plan, data_wait=data_wait)
                scaled = loss.float() * (micro.samples * scale)
                if self.scaler is not None:
                    self.scaler.scale(scaled).backward()
                else:
                    scaled.backward()
        if control is None:
            raise RuntimeError(f"step {self.step + 1} has no micro-batch on rank {env.rank}")
        return control

    def _update(self, plan: StepPlan, control: _StepControl) -> None:
        """The update section: everything that turns "after step S" into "after step S+1".

        Held under the guard, so that a just-in-time snapshot sees one or the other, never a mix.
        When rank 0's buffers of the step ride on its control allreduce, no rank updates before
        that allreduce completed: a survivor then always holds the buffers that belong to its
        weights (step S's, or step S+1's; see :mod:`elastic_trainer.checkpoint.jit`, "Buffers").
        """
        if control.buffers_at is not None and control.work is not None:
            control.work.wait()  # raises if a peer died: the state stays "after step S"
            control.work = None
            if control.control.device.type == "cuda":
                # NCCL's wait() only orders streams. Block the host as well: a control allreduce
                # that never completes (dead peer) must leave the update unqueued, or the host
                # would record "step S+1" while the GPU stays at S (and a JIT snapshot, which
                # waits for the last update's event, would wait forever). Not run on CPU CI.
                torch.cuda.current_stream(control.control.device).synchronize()
            control.complete = True  # its loss and stop flag can be read without waiting
        with self._guard.update():
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.sampler.advance(plan)
            self.step += 1
            self._after_update(control)

    def _log_progress(self, loss: float | None, samples_per_s: float, step: int) -> None:
        lr = self.optimizer.param_groups[0]["lr"]
        log.info("step %d epoch %d loss %.4f samples/s %.1f world %d lr %.3g",
                 step, self.sampler.epoch, float("nan") if loss is None else loss, samples_per_s,
                 self.env.world_size if self.env else 1, lr)

    # -- checkpoints -------------------------------------------------------------------------------
    def _checkpoint(self, *, final: bool) -> str | None:
        """Checkpoint the current step (collective: every rank calls it at the same step).

        Rank 0 writes; every rank learns the outcome from rank 0 (so a failed write is an error
        on every rank, never a hang at a barrier), which is also the barrier that keeps the
        other ranks from going on (or exiting) before the file is in place.
        """
        cfg, env = self.config, self._env()
        if cfg.checkpoint_dir is None or self._last_saved_step == self.step:
            return self._last_checkpoint
        started = time.monotonic()
        if cfg.zero_redundancy:
            self.optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        outcome: list[Any] = [("ok", None)]
        if env.is_rank0:
            try:
                outcome = [("ok", self._write(sync=final or not cfg.async_checkpoint, started=started))]
            except ckpt.CheckpointError as exc:
                outcome = [("error", str(exc))]
        if env.world_size > 1:
            dist.broadcast_object_list(outcome, src=0)
        kind, value = outcome[0]
        if kind == "error":
            raise ckpt.CheckpointWriteError(value)
        self._last_saved_step = self.step
        self._last_checkpoint = value
        return value

    def _payload(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint holds (live tensors; the caller copies or writes them at once)."""
        cfg, env = self.config, self._env()
        return {
            "format": ckpt.FORMAT,
            "model": model_state,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "sampler": self.sampler.state_dict(),
            "rng": {"scheme": rng.STEP_SCHEME, "seed": cfg.seed},
            "step": self.step,
            "epoch": self.sampler.epoch,
            "world_size": env.world_size,
            "fingerprint": ckpt.job_fingerprint(self.fingerprint_fields),
            "config": cfg.to_dict(),
        }

    def _write(self, *, sync: bool, started: float) -> str:
        cfg, env = self.config, self.env
        if env is None or cfg.checkpoint_dir is None:
            raise RuntimeError("checkpointing needs the distributed environment and a checkpoint_dir")
        payload = self._payload(self.model.state_dict())
        step, epoch, directory = self.step, self.sampler.epoch, cfg.checkpoint_dir
        path = str(ckpt.checkpoint_path(directory, step))
        claim: ckpt.StepClaim | None = None
        if self._jit.enabled:
            # One writer per step: a survivor may be writing this step just in time (the group is
            # failing); it will finish it.
            try:
                claim = ckpt.try_claim(directory, step, rank=env.rank, kind="periodic")
            except OSError as exc:
                raise ckpt.CheckpointWriteError(
                    f"could not write the checkpoint of step {step} to {directory}: {exc.strerror or exc}") from exc
            if claim is None:
                log.warning("step %d is being checkpointed by %s; not writing it again", step,
                            ckpt.read_claim(directory, step) or "another writer")
                return path

        def save(data: dict[str, Any]) -> ckpt.CheckpointInfo:
            try:
                return ckpt.save_checkpoint(directory, data, step=step, epoch=epoch, world_size=env.world_size,
                                            fingerprint_fields=self.fingerprint_fields, keep_last=cfg.keep_last)
            finally:
                if claim is not None:
                    claim.release()

        if sync:
            try:
                self._writer.wait(self._stop.remaining_s())
            except BaseException:
                if claim is not None:
                    claim.release()
                raise
            info = save(payload)
            nbytes = info.manifest.nbytes
        else:
            try:
                snapshot = ckpt.snapshot_to_cpu(payload)  # on this thread: the next step changes the tensors
                nbytes = _nbytes(snapshot)
                self._writer.submit(lambda: save(snapshot))
            except BaseException:
                if claim is not None:
                    claim.release()
                raise
        self.observer.on_checkpoint_saved(step=step, duration_s=time.monotonic() - started, nbytes=nbytes)
        return path

    def _finish_background_write(self) -> None:
        if not self._writer.busy:
            return
        timeout = self._stop.remaining_s() or self.config.sigterm_grace_s
        try:
            self._writer.wait(timeout)
        except ckpt.CheckpointError:
            log.exception("the last background checkpoint write failed")


ENV_TEST_KILL_AT = "ELASTIC_TRAINER_TEST_KILL_AT"
"""Fault injection for tests: ``RANK:STEP:POINT`` SIGKILLs that rank's worker at ``POINT`` of step
``STEP`` in the first generation of workers (``TORCHELASTIC_RESTART_COUNT`` 0). Points:
``before_control`` (last forward done, the step's control allreduce not started) and ``after_update``
(the step's update applied, before the next collective)."""
_KILL_POINTS = ("before_control", "after_update")


def _parse_kill_at(raw: str | None) -> tuple[int, int, str] | None:
    if raw is None or not raw.strip():
        return None
    try:
        rank, step, point = raw.strip().split(":")
        parsed = (int(rank), int(step), point)
    except ValueError:
        raise ValueError(f"{ENV_TEST_KILL_AT}: expected RANK:STEP:POINT, got {raw!r}") from None
    if point not in _KILL_POINTS:
        raise ValueError(f"{ENV_TEST_KILL_AT}: POINT must be one of {', '.join(_KILL_POINTS)}, got {point!r}")
    return parsed




ENV_METRICS = "ELASTIC_TRAINER_METRICS"
"""``1``: workers report metrics through :func:`elastic_trainer.metrics.worker.worker_observer`."""


def build_observer() -> TrainingObserver:
    """The observer a worker should use: metrics when ``ELASTIC_TRAINER_METRICS=1``, else none.

    Raises:
        TrainerSetupError: metrics were asked for but the metrics module cannot provide them.
    """
    if os.environ.get(ENV_METRICS, "0").strip().lower() not in ("1", "true", "yes"):
        return NullObserver()
    try:
        from elastic_trainer.metrics.worker import worker_observer
    except ImportError as exc:
        raise TrainerSetupError(
            f"{ENV_METRICS}=1 but elastic_trainer.metrics.worker.worker_observer cannot be imported ({exc}); "
            f"unset {ENV_METRICS} or install the metrics extra"
        ) from exc
    return worker_observer()


def ensure_progress_logging(rank: int) -> None:
    """Show the runtime's progress lines (INFO) when the program configured no logging at all.

    A program that set up logging (any handler on the root logger or on ``elastic_trainer``) keeps
    its own configuration.
    """
    package = logging.getLogger("elastic_trainer")
    if logging.getLogger().handlers or package.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"))
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)


def samples_per_step(config: TrainerConfig, world_size: int) -> str:
    """Human-readable split of a step over ``world_size`` ranks (for logs and docs)."""
    share = math.ceil(config.global_batch_size / world_size)
    micro = config.micro_batch_size or share
    return f"{config.global_batch_size} samples/step = {world_size} ranks x <= {share} (micro-batches of <= {micro})"
