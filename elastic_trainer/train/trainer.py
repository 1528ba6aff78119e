"""The Trainer: a :class:`TrainingJob` under DDP, set up the way the DDP guides ask, on the own-loop
API (:class:`~elastic_trainer.train.elastic.Elastic`): its loop body is one user of it.

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=demo \\
        --nnodes=1:2 --nproc-per-node=2 -m elastic_trainer.examples.synthetic_cnn \\
        --global-batch-size 64 --max-steps 200 --checkpoint-dir /shared/ckpt

What it adds to the loop's guarantees (exact resume, exactly-once data, graceful stop, checkpoints,
just-in-time save): identical initial weights on every rank (seeded before the model factory);
the model on its device before DDP; SyncBatchNorm, bf16/fp16 autocast with a GradScaler,
ZeroRedundancyOptimizer, gradient clipping; a step whose maths does not depend on the world size
(each rank's loss scaled so DDP's average is the mean over the global batch, ``no_sync``
accumulation beyond ``micro_batch_size``); DDP's buckets primed after a restart so that three or
more ranks reduce bitwise as an uninterrupted run (``docs/design/exact-resume.md``); evaluation and
callbacks between steps. ``fit()`` returns whether the job finished or this process must exit for
a restart.

With ``TrainerConfig(fsdp=FSDPOptions(blocks=("blocks.*",)))`` (or a model factory that returns a
model it sharded with ``fully_shard``) the model is sharded with FSDP2 instead of replicated:
no DDP, each rank holds and checkpoints its own shards, a restart at another world size reshards,
and under ``elastic-trainer run`` a worker's failure heals in place: the model is built and sharded
again on the healed group, and each rank's shard comes from its neighbour's copy
(``TrainerConfig.shard_copy``; ``docs/design/sharded.md``). Under plain torchrun the survivors
write the dead rank's shards from that copy into a just-in-time checkpoint, and the restart
resumes from the last completed step.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from elastic_trainer.checkpoint.manager import CheckpointManager
from elastic_trainer.metrics.choice import build_observer
from elastic_trainer.runtime import distributed, rng, torch_compat
from elastic_trainer.runtime.exit_codes import EXIT_STOPPED
from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.runtime.observer import TrainingObserver
from elastic_trainer.runtime.sampler import ElasticSampler
from elastic_trainer.runtime.settings import WorkerSettings
from elastic_trainer.state.sharded import is_sharded
from elastic_trainer.train.config import TrainerConfig
from elastic_trainer.train.elastic import Elastic, Step
from elastic_trainer.train.elastic_group import ElasticGroup
from elastic_trainer.train.fsdp import shard_model
from elastic_trainer.train.loop import (
    ElasticLoop,
    FaultHook,
    TrainResult,
    ensure_progress_logging,
    total_steps,
)

__all__ = [
    "EXIT_STOPPED",
    "Callback",
    "TrainResult",
    "Trainer",
    "TrainerSetupError",
    "TrainingJob",
    "ensure_progress_logging",
]

log = logging.getLogger(__name__)


class TrainerSetupError(ConfigError):
    """The job or config cannot run here; the message says what to change."""


Callback = Callable[["Trainer", int], None]
"""``callback(trainer, step)`` after every step, on every rank, between steps: after the update, the
step's checkpoint and evaluation. It may log, read the model or run collectives (every rank calls
it at the same step); it must not change what is saved (model, optimizer, ...), or exact resume
breaks. Random numbers it draws do not change training (the next step reseeds)."""


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
    """Builds an LR scheduler, stepped once per optimizer step (:attr:`Trainer.total_steps` is the
    number of steps, for schedules that need it)."""
    evaluate: Callable[[nn.Module, int], Mapping[str, float] | None] | None = None
    """``evaluate(model, step)`` every ``eval_every`` steps, on every rank, in eval mode under
    ``torch.no_grad()`` (train mode is restored after): return metrics for rank 0's log. It may run
    collectives (every rank calls it at the same step); its random numbers do not change training."""
    tokens_per_sample: int = 0
    """Reported to the observer (tokens/s); 0 for non-sequence data."""


def _refuse_data_parallel(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, (nn.DataParallel, DDP)):
            where = f" (at {name!r})" if name else ""
            raise TrainerSetupError(
                f"the model factory returned a {type(module).__name__}-wrapped module{where}: return the plain "
                "module; the runtime runs one process per device and wraps it in DistributedDataParallel itself "
                "(nn.DataParallel is single-process and not supported)"
            )


class Trainer:
    """Runs a :class:`TrainingJob` under DDP on the current worker; see the module docstring.

    Args:
        config: runtime settings.
        job: the factories.
        observer: receives events; default: :func:`build_observer` (Prometheus metrics under
            ``elastic-trainer run``).
        env: the worker's place in the job; default: read from torchrun's environment.
        settings: the worker's environment settings; default: parsed once by :meth:`fit`.
        callbacks: called after every step (:data:`Callback`).
        fault_hook: test seam (``elastic_trainer.train.loop.FaultHook``).
    """

    def __init__(
        self,
        config: TrainerConfig,
        job: TrainingJob,
        *,
        observer: TrainingObserver | None = None,
        env: distributed.DistEnv | None = None,
        settings: WorkerSettings | None = None,
        callbacks: Sequence[Callback] = (),
        fault_hook: FaultHook | None = None,
    ) -> None:
        self.config = config
        self.job = job
        self.env = env
        self.settings = settings
        self._observer = observer
        self.callbacks = list(callbacks)
        self._fault_hook = fault_hook
        self.loop: ElasticLoop | None = None
        """The loop of the current attempt (a new one after each in-place heal)."""
        self.checkpoints: CheckpointManager | None = None
        self.elastic: Elastic | None = None

    # -- public --------------------------------------------------------------------------------
    @property
    def observer(self) -> TrainingObserver:
        if self._observer is None:
            raise RuntimeError("the trainer's observer is chosen when fit() starts")
        return self._observer

    @observer.setter
    def observer(self, observer: TrainingObserver) -> None:
        self._observer = observer

    @property
    def ddp(self) -> nn.Module:
        """What the forward runs on while :meth:`fit` trains: the model in DDP over the current
        process group, or the sharded (FSDP2) model itself."""
        module = self.elastic.ddp if self.elastic is not None else None
        if module is None:
            raise RuntimeError("the trainer's DDP exists while fit() trains")
        return module

    @property
    def module(self) -> nn.Module:
        """What the forward runs on: :attr:`ddp`, or the sharded (FSDP2) model itself."""
        if self.elastic is None:
            raise RuntimeError("the trainer's model is wrapped while fit() trains")
        return self.elastic.module

    @property
    def sampler(self) -> ElasticSampler:
        if self.elastic is None:
            raise RuntimeError("the trainer's sampler is made when fit() starts")
        return self.elastic.sampler

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self.loop.step if self.loop is not None else 0

    @property
    def resumed_from(self) -> int | None:
        return self.loop.resumed_from if self.loop is not None else None

    @property
    def total_steps(self) -> int:
        """Optimizer steps the job trains for in all: ``max_steps``, or ``epochs`` x steps per epoch
        (``ceil(dataset size / global_batch_size)``, the last step of an epoch takes what is left),
        whichever comes first. For LR schedules and progress; known once :meth:`fit` set up the data."""
        cfg = self.config
        return total_steps(len(self.sampler), epochs=cfg.epochs, max_steps=cfg.max_steps)

    def fit(self) -> TrainResult:
        """Train until ``epochs``/``max_steps`` are done or every rank agreed to stop (a signal).

        Creates the process group unless one exists, and destroys what it created on every exit
        path. Rank 0 writes the final checkpoint.

        Returns:
            How it ended. ``result.finished`` is False when this process was stopped (scale-down,
            preemption, a new member): then skip end-of-training code and exit with
            ``result.exit_code``; torchrun restarts the group.
        """
        settings = self.settings if self.settings is not None else WorkerSettings.from_environ()
        self.settings = settings
        env = self.env or distributed.read_env(backend=self.config.backend)
        self.env = env
        if self._observer is None:
            # Metrics by default wherever the launcher collects them (ELASTIC_TRAINER_METRICS=1).
            self._observer = build_observer(settings)
        ensure_progress_logging(env.rank)
        with ElasticGroup(settings, env, pg_timeout_s=self.config.pg_timeout(settings)) as group:
            self.env = group.env
            if group.ended:  # the job finished before this process could join it
                result = group.result
            else:
                with group.groups():  # a sharded model's mesh is aborted at a heal
                    self._setup()
                self.elastic = self._make_elastic(group)
                for step in self.elastic:
                    with step:  # a peer's failure is healed in place here; the next attempt goes on
                        self._train_step(step)
                result = self.elastic.result
        if result is None:
            raise RuntimeError("the training loop ended without a result")
        return result

    # -- setup ---------------------------------------------------------------------------------
    def _env(self) -> distributed.DistEnv:
        if self.env is None:
            raise RuntimeError("trainer used before its distributed environment was read")
        return self.env

    def _setup(self) -> None:
        cfg, env = self.config, self._env()
        device = env.device
        if cfg.sync_batchnorm and device.type != "cuda":
            raise TrainerSetupError(
                "sync_batchnorm: torch's SyncBatchNorm runs on CUDA devices only; this worker is on CPU"
            )
        if cfg.mixed_precision == "fp16" and device.type != "cuda":
            raise TrainerSetupError(
                "mixed_precision: fp16 (with a GradScaler) needs CUDA; use bf16 on CPU"
            )
        model = self._build_model(env)
        if cfg.zero_redundancy and is_sharded(model):
            raise TrainerSetupError(
                "zero_redundancy: the model is sharded (FSDP2), which shards the optimizer already"
            )
        self.model = model

        optimizer = self.job.optimizer(model.parameters())
        if cfg.zero_redundancy:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            if len(optimizer.param_groups) != 1:
                raise TrainerSetupError(
                    "zero_redundancy: the optimizer factory must build a single parameter group"
                )
            # Rebuild the same optimizer sharded: its hyper-parameters are its ``defaults``, less
            # those its constructor does not take (AdamW keeps ``decoupled_weight_decay`` there).
            accepted = inspect.signature(type(optimizer).__init__).parameters
            defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            optimizer = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=type(optimizer), **defaults
            )
        self.optimizer = optimizer
        self.scheduler = self.job.scheduler(optimizer) if self.job.scheduler is not None else None
        self.scaler = torch.amp.GradScaler("cuda") if cfg.mixed_precision == "fp16" else None
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            cfg.mixed_precision
        )

        self.dataset = self.job.dataset()
        try:
            dataset_size = len(self.dataset)  # type: ignore[arg-type]
        except TypeError:
            raise TrainerSetupError(
                f"the dataset factory returned a {type(self.dataset).__name__} without __len__: the elastic sampler "
                "needs a map-style dataset (indexable, with a length); for a stream, write your own loop on "
                "ElasticLoop (README, 'Your own training loop')"
            ) from None
        if dataset_size == 0:
            raise TrainerSetupError("the dataset factory returned an empty dataset")

    def _build_model(self, env: distributed.DistEnv) -> nn.Module:
        """The job's model on this rank's device, seeded alike on every rank, and sharded with
        ``fsdp`` over the current process group."""
        cfg = self.config
        rng.seed_all(cfg.seed)  # identical initial weights on every rank
        model = self.job.model()
        if not isinstance(model, nn.Module):
            raise TrainerSetupError(
                f"the model factory returned {type(model).__name__}, not an nn.Module"
            )
        _refuse_data_parallel(model)
        if cfg.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(env.device)  # before DDP: DDP wraps the parameters where they are
        if cfg.fsdp is not None:
            if is_sharded(model):
                raise TrainerSetupError(
                    "fsdp: the model factory returned a model that is sharded already; leave fsdp "
                    "unset to train it as it is, or return the plain model"
                )
            model = shard_model(model, cfg.fsdp, env.device, env.world_size)
        return model

    def _rebuild(self, env: distributed.DistEnv) -> dict[str, Any]:
        """(A sharded model, after an in-place heal) the model, its optimizer and scheduler built
        again over the new group (FSDP2 binds them to the group they were sharded on); the heal
        then puts this rank's shards back into them, or the newest checkpoint."""
        self.env = env
        self.model = self._build_model(env)
        self.optimizer = self.job.optimizer(self.model.parameters())
        self.scheduler = (
            self.job.scheduler(self.optimizer) if self.job.scheduler is not None else None
        )
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}

    def _make_elastic(self, group: ElasticGroup) -> Elastic:
        """The run on the own-loop API, over ``group`` (the trainer's), saving what the job built."""
        cfg, settings = (
            self.config,
            self.settings if self.settings is not None else WorkerSettings(),
        )
        ddp = cfg.ddp
        return Elastic(
            self.model,
            self.dataset,
            config=cfg,
            scaler=self.scaler,
            find=False,
            states={
                "optimizer": self.optimizer,
                "scheduler": self.scheduler,
                "scaler": self.scaler,
            },
            ddp_options={
                "bucket_cap_mb": ddp.bucket_cap_mb,
                "find_unused_parameters": ddp.find_unused_parameters,
                "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
                "static_graph": ddp.static_graph,
                "broadcast_buffers": ddp.broadcast_buffers,
            },
            tokens_per_sample=self.job.tokens_per_sample,
            after_step=[self._between_steps],
            rebuild=self._rebuild if is_sharded(self.model) else None,
            group=group,
            run_config=cfg.to_dict(),
            settings=settings,
            env=self._env(),
            observer=self.observer,
            fault_hook=self._fault_hook,
        )

    def _lr(self) -> float | None:
        lr = self.optimizer.param_groups[0]["lr"]
        return lr if isinstance(lr, float) else None  # a tensor lr would synchronise

    # -- the loop --------------------------------------------------------------------------------
    def _forward_loss(self, inputs: Any, target: Any) -> torch.Tensor:
        """The DDP forward and the job's loss of one micro-batch (under autocast with mixed precision)."""
        device_type = self._env().device.type
        with torch.autocast(
            device_type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        ):
            return self.job.loss(self.module(inputs), target)

    def _train_step(self, step: Step) -> None:
        """One step, as the DDP guides write it, on the own-loop API: ``no_sync`` accumulation and
        each micro-batch's loss weighted so that DDP's average is the mean over the global batch
        whatever the number of ranks (``step.weight``); the control allreduce overlaps the last
        backward (``step.backward``)."""
        elastic = self.elastic
        if elastic is None:
            raise RuntimeError("a step outside fit()")
        if (
            elastic.loop is not self.loop
        ):  # the first step of an attempt (a start, a resume, a heal)
            self.loop = elastic.loop
            self.checkpoints = elastic.loop.checkpoints if elastic.loop is not None else None
            # A heal in place changes this rank's world and rank: what follows (the priming
            # passes) must be decided alike on every rank, a survivor and a newcomer too.
            self.env = elastic.env
            self.module.train()
            passes = self._priming_passes()
            if passes:
                list(self._prime_buckets(iter([elastic.peek_batch(step.plan)]), passes=passes))
        self.optimizer.zero_grad(set_to_none=True)
        for inputs, target in step:
            step.backward(self._forward_loss(inputs, target).float() * step.weight)
        if self.scaler is not None:
            if self.config.grad_clip_norm is not None:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if self.config.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip_norm)
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def _between_steps(self, step: int) -> None:
        cfg = self.config
        if (
            cfg.eval_every is not None
            and self.job.evaluate is not None
            and step % cfg.eval_every == 0
        ):
            self.module.eval()
            try:
                with torch.no_grad():
                    metrics = self.job.evaluate(self.model, step)
            finally:
                self.module.train()
            if metrics and self._env().is_rank0:
                log.info(
                    "eval at step %d: %s",
                    step,
                    " ".join(f"{k} {v:.6g}" for k, v in metrics.items()),
                )
        for callback in self.callbacks:
            callback(self, step)

    # -- DDP bucket layout after a restart ------------------------------------------------------------
    def _priming_passes(self) -> int:
        """How many throw-away forward/backward passes make a resumed DDP reduce like an
        uninterrupted one; 0 when nothing needs priming.

        DDP (torch 2.13) reduces a fresh instance's first iteration in its initial bucket layout
        and rebuilds its buckets in gradient-ready order at the next forward; a ring allreduce over
        three or more ranks sums in a layout-dependent order, so a fresh DDP after a restart would
        not be bitwise (``docs/design/exact-resume.md``). With ``static_graph`` every start needs a
        synchronised first backward (pytorch/pytorch#143580), and the rebuild comes one pass later.
        """
        cfg, env = self.config, self._env()
        step = self.step
        if self.elastic is not None and self.elastic.state.sharded is not None:
            return 0  # no DDP buckets: FSDP2's reduce-scatter has one fixed layout per unit
        if cfg.ddp.static_graph:
            return 1 if step == 0 or env.world_size == 1 else 2
        if step == 0 or env.world_size == 1:
            return 0  # a fresh start is what the uninterrupted run did too
        if cfg.ddp.find_unused_parameters:
            return 0  # the reducer never rebuilds its buckets: a fresh layout is the only layout
        return 1

    def _prime_buckets(self, batches: Iterator[Any], *, passes: int) -> Iterator[Any]:
        """After a restart, bring DDP's bucket layout to where an uninterrupted run has it.

        Runs ``passes`` synchronised forward/backward passes on the first micro-batch of the step
        about to run (handed back to it) and leaves no trace: gradients dropped, module buffers and
        generators restored, nothing else touched.
        """
        env = self._env()
        device = env.device
        first = next(batches)
        inputs, target = first
        generators = rng.capture(device)
        saved = [
            (module, name, buffer, buffer.detach().clone())
            for module in self.model.modules()
            for name, buffer in torch_compat.own_buffers(module)
        ]
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
                torch_compat.set_own_buffer(module, name, buffer)  # in case the forward replaced it
        rng.restore(generators, device)
        log.debug("primed DDP's buckets with %d pass(es) before step %d", passes, self.step + 1)
        return itertools.chain([first], batches)
