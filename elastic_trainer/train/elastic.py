"""Your own DDP loop, elastic: one object around it, the loop body stays yours.

    from elastic_trainer import Elastic

    elastic = Elastic(model, dataset, global_batch_size=64, micro_batch_size=16, max_steps=1000,
                      checkpoint_dir="/shared/ckpt")          # finds the optimizers and schedulers
    for step in elastic:                                      # resumed; this rank's share of each step
        with step:                                            # a peer's failure in here heals in place
            for x, y in step:                                 # micro-batches (no_sync but the last)
                step.backward(loss_fn(elastic.ddp(x), y) * step.weight)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    sys.exit(elastic.result.exit_code)

What it does around the body: forms the process group (instead of ``init_process_group``) and,
under ``elastic-trainer run``, heals it in place when a peer dies (the survivors keep their
objects; a replacement takes the state from a live peer); wraps the model in DDP over the current
group (:attr:`Elastic.ddp`); resumes from the newest checkpoint; hands out each step's samples
exactly once per epoch at any world size (:class:`~elastic_trainer.runtime.sampler.ElasticSampler`);
reseeds every rank's random numbers at each step; saves periodic, final, SIGTERM and just-in-time
checkpoints; reports progress lines and metrics. A model you sharded with ``fully_shard`` (FSDP2)
is not wrapped: its state is read and written through DCP's state-dict API and its checkpoints
are sharded, every rank writing its own shards (``TrainingState.sharded``; ``docs/design/sharded.md``);
built and sharded inside ``with ElasticGroup() as group:`` and given with ``group=group,
rebuild=...`` it also heals in place, from a neighbour's copy of each shard. Call
:attr:`Elastic.module` for the forward in either case. What it saves is a
:class:`~elastic_trainer.state.training_state.TrainingState`: the model, the sampler, and what it
finds (every optimizer over the model's parameters, their LR schedulers, the ``scaler`` given).

The step's update section (a just-in-time save or a peer's snapshot never sees half of it) runs
from the last micro-batch's :meth:`Step.backward` (or the first optimizer step) to the end of
``with step:``; everything that changes the saved state goes there, once per step. Code after
``with step:`` runs between steps (evaluation, logging: :attr:`Elastic.reported_loss` is the
global mean loss): after a failure that the ``with`` took for healing, :attr:`Step.completed` is
False. Design: ``docs/design/own-loop.md``.
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint.manager import CheckpointManager
from elastic_trainer.metrics.choice import build_observer
from elastic_trainer.runtime import distributed, failures, rng
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.grad_carrier import ControlCarrier
from elastic_trainer.runtime.observer import TrainingObserver
from elastic_trainer.runtime.process_exit import exit_process
from elastic_trainer.runtime.sampler import ElasticSampler, MicroBatch, MicroBatchSampler, StepPlan
from elastic_trainer.runtime.settings import WorkerSettings
from elastic_trainer.runtime.shard_carrier import ShardCarrier
from elastic_trainer.state.buffers import replaces_buffer_broadcast
from elastic_trainer.state.neighbour_copy import NeighbourCopy, NeighbourCopyConfig
from elastic_trainer.state.training_state import (
    ReplicaMismatchError,
    Stateful,
    TrainingState,
    find_states,
)
from elastic_trainer.train import state_audit
from elastic_trainer.train.after_failure import AfterFailureTrace, after_failure_message
from elastic_trainer.train.config import RunConfig, RunOptions, run_config_from
from elastic_trainer.train.elastic_group import Attempt, ElasticGroup
from elastic_trainer.train.fsdp import no_gradient_sync
from elastic_trainer.train.loop import (
    ElasticLoop,
    FaultHook,
    TrainResult,
    check_sampler,
    ensure_progress_logging,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)

PROG = "elastic_trainer"


def move_to(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensors in lists, tuples, dicts) on ``device`` (asynchronously from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch


def tokens_per_sample_of(batch: Any) -> int:
    """The tokens a sample of ``batch`` holds when its first tensor is token ids (integers, one
    row a sample: ``(batch, sequence, ...)``); 0 otherwise."""
    first = batch
    while isinstance(first, (list, tuple, dict)) and first:
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    if isinstance(first, torch.Tensor) and first.dim() >= 2 and not first.is_floating_point():
        return int(first[0].numel()) if first.dtype != torch.bool else 0
    return 0


SHARDED_RECIPE = (
    "build and shard the model inside `with ElasticGroup() as group:` and pass "
    "`Elastic(..., group=group, rebuild=...)` (docs/own-loop.md, 'A model you shard yourself')"
)


def healing_advice(
    *, heal_on: bool, group_heals: bool, own_group: bool, sharded: bool, rebuild: bool
) -> str | None:
    """The one line that says why a run under ``elastic-trainer run`` (``heal_on``) will not heal
    in place, and what to write instead; ``None`` when it heals (or healing is off anyway).

    ``group_heals``: the group has a healer, which it has only when it formed the process group
    itself; one that existed before (``init_process_group``, or ``fully_shard`` and
    ``init_device_mesh``, which create the default group) is used as it is. ``own_group``: the
    group is the one :class:`Elastic` formed (no ``group=``)."""
    if not heal_on:
        return None
    if not group_heals:
        where = "Elastic" if own_group else "ElasticGroup was entered"
        if sharded:
            return (
                "healing in place is off for this job: the process group existed before "
                f"{where} (fully_shard and init_device_mesh create it), so a worker's failure "
                f"restarts every worker from the newest checkpoint; {SHARDED_RECIPE}"
            )
        return (
            "healing in place is off for this job: the process group existed before "
            f"{where} (init_process_group was called), so a worker's failure restarts every "
            "worker from the newest checkpoint; leave forming the process group to Elastic "
            "(or to `with ElasticGroup() as group:` and `Elastic(..., group=group)`)"
        )
    if sharded and not rebuild:
        return (
            "healing in place is off for this job: the model is sharded and Elastic has no "
            "rebuild= to shard it again on a healed group, so a worker's failure restarts every "
            f"worker from the newest checkpoint; {SHARDED_RECIPE}"
        )
    return None


def shard_copy_use(
    *, heals: bool, every: int, world_size: int, saves_just_in_time: bool, one_dim: bool = True
) -> str | None:
    """What an attempt of a sharded model keeps the neighbour copy of its shards for.

    ``"heal"``: the group heals in place (``heals``: a healer, and ``rebuild`` to shard the model
    again); a lost shard comes from the copy (with ``every`` 0 the copy holds nothing, and a heal
    reloads the newest checkpoint in place). ``"save"``: a failure restarts the group (plain
    torchrun, ``--heal off``, no ``rebuild``) and the just-in-time save writes a lost rank's
    shards from the copy: kept when the copy is on (``every`` > 0), there is a neighbour, and the
    save is (a checkpoint directory, ``jit_save``) and can place a copy's shards (``one_dim``:
    FSDP's 1-D mesh; ``sharded_jit.place`` refuses HSDP's 2-D one), at the same default interval
    as for a heal (every step: a worker's death then costs at most one step,
    ``docs/design/sharded.md``). ``None``: nothing would use it (it would only cost)."""
    if heals:
        return "heal"
    if every > 0 and world_size > 1 and saves_just_in_time and one_dim:
        return "save"
    return None


_HOOKED = "_elastic_trainer_one_line"


def one_line_for_uncaught_failures(*, peer_failures: bool) -> None:
    """From now on an uncaught exception of this process that a restart cannot fix (a
    ``DeterministicError``: a checkpoint of another job, an optimizer the run does not save) is
    told in one line and the process exits 2, as :class:`Elastic` ends such a mistake when it owns
    the group; with ``peer_failures`` (plain torchrun) one that is a peer's failure (a collective
    that failed because a peer died or timed out: ``failures.classify`` says ``TRANSIENT``) is
    told in one line too, recorded for torchrun, and the process exits 1. A ``sys.excepthook``,
    installed once (a later call can add ``peer_failures``), that hands every other exception to
    the hook before it. For a mistake that reaches a program passing ``group=`` and that it does
    not catch, and for a collective of the loop body outside ``with step:`` (a metric's
    ``all_reduce`` between steps), which never passes through the run: their tracebacks would
    show the library's or gloo's internals, not the program's error."""
    installed = getattr(sys.excepthook, _HOOKED, None)
    if installed is not None:
        installed["peer_failures"] = installed["peer_failures"] or peer_failures
        return
    previous = sys.excepthook
    settings = {"peer_failures": peer_failures}

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if isinstance(exc, Exception):
            kind_of = failures.classify(exc)[0]
            try:
                if kind_of is failures.FailureClass.DETERMINISTIC:
                    exit_process(failures.exit_after(exc, prog=PROG))
                if kind_of is failures.FailureClass.TRANSIENT and settings["peer_failures"]:
                    failures.exit_after(exc, prog=PROG)
                    return
            except Exception:  # noqa: BLE001 - the report failed: the usual traceback instead
                pass
        previous(kind, exc, tb)

    setattr(hook, _HOOKED, settings)
    sys.excepthook = hook


class _Nothing:
    """A no-op context (``contextlib.nullcontext`` without the allocation per micro-batch)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NOTHING = _Nothing()


class Elastic:
    """An elastic run of your own loop; see the module docstring.

    Args:
        model: the plain model, on this rank's device (:attr:`device`), identical on every rank
            (seed before building it). Not DDP-wrapped: :attr:`ddp` is. Or a model sharded with
            ``fully_shard`` (FSDP2) over the current process group: used as it is.
        dataset: a map-style dataset (``for batch in step`` loads each micro-batch with a
            DataLoader), or its size (``for micro in step`` gives the indices to load yourself).
        config: the run's settings as one :class:`~elastic_trainer.train.config.RunConfig`; or
            give its fields as keyword arguments (``**options``): ``global_batch_size`` (samples
            per optimizer step over all ranks, whatever the world size; required),
            ``micro_batch_size`` (at most this many samples per forward: gradient accumulation),
            ``max_steps`` (``None``: all ``epochs``), ``epochs`` (``None``: as many as
            ``max_steps`` takes; one without it), ``seed`` (the data order and every step's
            random numbers derive from it), ``shuffle``, ``checkpoint`` (a ``CheckpointConfig``),
            ``log_every``, ``num_workers`` (the DataLoader's), ``record_samples_dir`` (audit:
            every rank records every step's indices there), ``shard_copy`` (see below),
            ``sigterm_grace_s`` and ``pg_timeout_s`` (the stop's grace period and the collective
            timeout; default the environment's). Each default is ``RunConfig``'s.
        checkpoint_dir: a directory every node shares (``None``: no checkpoints, no resume).
        checkpoint_every: steps between periodic checkpoints (with ``checkpoint_dir``; short for
            ``checkpoint=CheckpointConfig(directory=..., every=...)``).
        scaler: a ``torch.amp.GradScaler``: saved, and :meth:`Step.backward` scales with it.
        states: more objects to save (name -> anything with ``state_dict``/``load_state_dict``);
            the model's optimizers and their schedulers are found without it. Saved from rank 0
            and restored on every rank: after the first step of each attempt rank 0 warns in one
            line about those that differ between the ranks (per-rank state), and after the first
            steps about stateful variables of the loop's frame left out whose state changed
            (``state_audit``).
        ignore_states: names those two warnings leave alone (a variable left unsaved on
            purpose, a ``states`` key whose per-rank copies you accept).
        find: find the optimizers and schedulers (``False``: ``states`` lists everything).
        collate_fn: for the DataLoader of a map-style ``dataset``.
        ddp_options: keyword arguments for ``DistributedDataParallel`` (``bucket_cap_mb``, ...). On
            the CPU with more than one rank, rank 0's module buffers ride on each step's control
            allreduce instead of DDP's broadcast at every forward (one collective a step fewer),
            unless ``broadcast_buffers=False`` turns buffer syncing off altogether.
        tokens_per_sample: for the tokens/s metric (found from a map-style dataset's batches when
            their first tensor is integer token ids, one row a sample).
        after_step: called with the step number after each step, between steps, on every rank.
        rebuild: (a sharded model) ``rebuild(env)`` builds the model again, sharded over the
            current process group, and its optimizers and schedulers, and returns them by the
            names they are saved under (``{"model": ..., "optimizer": ..., ...}``); called at each
            attempt after an in-place heal (FSDP2 binds a model to the process groups it was
            sharded on). With it, under ``elastic-trainer run``, a worker's failure heals in
            place: each rank's shard is kept on a neighbour (``shard_copy``) and restored from
            there, or every rank reloads the newest checkpoint when no copy survived. Your loop
            body must then use the objects of :attr:`state` (``elastic.state.objects``), not
            the first ones. Without it a sharded run's group failure restarts from the newest
            checkpoint (the just-in-time one, written from the neighbour copy, when it is on).
            It heals only over a group that formed the process group (``group=``, see there).
            The :class:`~elastic_trainer.train.trainer.Trainer` passes its factories.
        shard_copy (in ``options``): (a sharded model) how often the neighbour copy of each rank's shard is
            refreshed: a heal in place restores a lost shard from it, and where a failure
            restarts the group instead (plain torchrun, no ``rebuild``) the just-in-time save
            writes the lost rank's shards from it; ``None``: ``ELASTIC_TRAINER_SHARD_COPY_EVERY``,
            default every step; ``every=0``: off.
        group: an entered :class:`ElasticGroup` the caller owns: the ``Trainer``'s, or yours when
            the model must be sharded before ``Elastic`` (build and shard it inside
            ``with ElasticGroup() as group:``, pass ``group=group, rebuild=...``;
            ``docs/own-loop.md``, "A model you shard yourself"). A mistake no restart can fix
            then reaches the caller as an exception; without it the run forms its own group and,
            as the owner of the process, ends such a mistake with one line and exit status 2.
            Either way, under plain torchrun a peer's failure the run could not heal ends the
            process for torchrun's restart: one line and ``SystemExit(1)``. A process group
            that existed before the group was formed (``init_process_group``, or ``fully_shard``
            and ``init_device_mesh``, which create the default group) cannot heal in place:
            under ``elastic-trainer run`` rank 0 then says so in one line at start.
        run_config: plain data stored in every checkpoint as ``"config"``.
        settings, env, observer, fault_hook: the worker's environment, place, metrics and a test
            seam; read from the environment when omitted.
    """

    def __init__(
        self,
        model: nn.Module,
        dataset: Dataset[Any] | int,
        *,
        config: RunConfig | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None,
        scaler: Any = None,
        states: Mapping[str, Stateful | None] | None = None,
        ignore_states: Collection[str] = (),
        find: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        ddp_options: Mapping[str, Any] | None = None,
        tokens_per_sample: int = 0,
        after_step: Sequence[Callable[[int], None]] = (),
        rebuild: Callable[[DistEnv], Mapping[str, Stateful | None]] | None = None,
        group: ElasticGroup | None = None,
        run_config: Mapping[str, Any] | None = None,
        settings: WorkerSettings | None = None,
        env: DistEnv | None = None,
        observer: TrainingObserver | None = None,
        fault_hook: FaultHook | None = None,
        **options: Unpack[RunOptions],
    ) -> None:
        self.config = run_config_from(config, options, checkpoint_dir, checkpoint_every)
        """The run's settings (:class:`~elastic_trainer.train.config.RunConfig`)."""
        cfg = self.config
        if isinstance(model, (DDP, nn.DataParallel)):
            raise failures.ConfigError(
                "Elastic(model): pass the plain model; Elastic wraps it in DDP (elastic.ddp) "
                "over the process group of the moment"
            )
        if isinstance(dataset, int):
            self.dataset: Dataset[Any] | None = None
            size = dataset
        else:
            self.dataset = dataset
            try:
                size = len(dataset)  # type: ignore[arg-type]
            except TypeError:
                raise failures.ConfigError(
                    f"Elastic(dataset): a {type(dataset).__name__} has no length; pass a map-style dataset, or the "
                    "number of samples and load each micro-batch's indices yourself"
                ) from None
        self.model = model
        self.settings = settings if settings is not None else WorkerSettings.from_environ()
        self.env = (
            env if env is not None else (group.env if group is not None else distributed.read_env())
        )
        self.sampler = ElasticSampler(
            size,
            cfg.global_batch_size,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
            micro_batch_size=cfg.micro_batch_size,
        )
        check_sampler(self.sampler)
        self.scaler = scaler
        found = (
            find_states(model, scaler=scaler)
            if find
            else ({"scaler": scaler} if scaler is not None else {})
        )
        objects: dict[str, Stateful | None] = {"model": model, **found}
        objects.update(states or {})
        self._own_states = {
            name: obj for name, obj in (states or {}).items() if name not in ignore_states
        }
        self.ignore_states = frozenset(ignore_states)
        objects["sampler"] = self.sampler
        self.state = TrainingState(objects, env=self.env, model=model, seed=cfg.seed)
        """What is saved, restored and handed to a peer (found here; see :func:`find_states`)."""
        self.fingerprint = {
            "model": ckpt.model_signature(model.state_dict()),
            "dataset_size": size,
            "seed": cfg.seed,
            "shuffle": cfg.shuffle,
        }
        self.collate_fn = collate_fn
        self.ddp_options = dict(ddp_options or {})
        self.tokens_per_sample = tokens_per_sample
        self.after_step = list(after_step)
        self._rebuild = rebuild if self.state.sharded is not None else None
        self._attempts_started = 0
        self._group = group
        self.run_config = dict(run_config or {})
        self._pending_batch: Any = None
        self._observer = observer
        self._fault_hook = fault_hook
        self._ddp: DDP | None = None  # over the current process group (a new one after each heal)
        self._carrier: ShardCarrier | None = None  # a sharded model's control carrier
        self.loop: ElasticLoop | None = None
        self.result: TrainResult | None = None
        """How the run ended (after the iteration): ``exit_code`` is what the process exits with.
        A stopped run (SIGTERM, a scale-down) without ``group=`` ends the iteration with
        ``SystemExit(exit_code)`` itself: the code after the loop is end-of-training code."""
        self._batches: Iterator[Any] | None = None
        self._loader_epoch = -1
        self._unsaved: state_audit.UnsavedWatch | None = None  # rank 0, until the first steps ran
        self._steps_run = 0  # by this process (every attempt)
        self._warned_after_failure = False  # after_failure.py: once per process
        self._loop_frame: Any = None  # the frame iterating the run, while it does
        self._earlier_loss: tuple[int, float] | None = None  # an earlier attempt's newest loss

    @property
    def ddp(self) -> nn.Module | None:
        """What the forward runs on (``elastic.ddp(x)``): the model in DDP over the current
        process group (a new one after each heal), or a model sharded with ``fully_shard`` itself
        (FSDP2 reduces its gradients in its own hooks; there is no DDP). ``None`` between
        attempts. On the CPU (gloo, 2 or more ranks) DDP wraps a
        :class:`~elastic_trainer.runtime.grad_carrier.ControlCarrier` around the model
        (``ddp.module.module`` is the model; save :attr:`model`, never ``ddp.module``)."""
        if self.state.sharded is not None:
            return self.model
        return self._ddp

    @property
    def module(self) -> nn.Module:
        """:attr:`ddp`, where an attempt runs (else a ``RuntimeError``)."""
        module = self.ddp
        if module is None:
            raise RuntimeError("the model has no DDP in this attempt")
        return module

    @property
    def device(self) -> torch.device:
        """This rank's device (build the model on it)."""
        return self.env.device

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self.state.step

    @property
    def reported_loss(self) -> tuple[int, float] | None:
        """``(step, loss)``: the mean loss over the global batch of the newest step whose loss
        arrived, alike on every rank (what the progress line prints); ``None`` before the first.
        It comes on the control allreduce of a later step (never waited for), so ``step`` is one
        or two behind :attr:`Step.number` during the run, and the last step after it."""
        loop = self.loop
        if loop is not None and loop.loss_step is not None and loop.loss is not None:
            return (loop.loss_step, loop.loss)
        return self._earlier_loss

    # -- the run ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Step]:
        ensure_progress_logging(self.env.rank)
        # A mistake that reaches a program passing group=, and under plain torchrun a collective
        # of the body between steps, too.
        one_line_for_uncaught_failures(peer_failures=self._restarted_by_torchrun())
        self._loop_frame = sys._getframe(1)  # the frame that iterates the loop
        if self.env.is_rank0:
            self._watch_unsaved(self._loop_frame)
        try:
            yield from self._run()
            if self._group is None and self.result is not None and not self.result.finished:
                # Stopped (SIGTERM, a scale-down, a new member), not finished: the code after the
                # loop is end-of-training code, and exit 0 would tell torchrun the job is done.
                raise SystemExit(self.result.exit_code)
        except (failures.DeterministicError, ReplicaMismatchError) as exc:
            # A mistake a restart cannot fix (a sampler without the elastic protocol, an unsaved
            # optimizer), or replicas that differ after a heal: one line, and the exit status the
            # launcher reads (2: no restart; 1: restart from the newest checkpoint). With the
            # program's own group (group=) it reaches the program as it is; a peer's failure
            # (below) ends the process whoever owns the group.
            if self._group is not None:
                raise
            raise SystemExit(failures.exit_after(exc, prog=PROG)) from exc
        except Exception as exc:
            if not self._ends_for_a_restart(exc):
                raise
            raise SystemExit(failures.exit_after(exc, prog=PROG)) from exc
        finally:
            self._loop_frame = None  # no reference cycle through the caller's frame

    def _ends_for_a_restart(self, exc: Exception) -> bool:
        """A peer's death or a failed collective this process could not heal, under plain torchrun:
        the survivor says so in one line and exits 1 for torchrun to restart the group (its
        traceback would show torch's internals, not the program's error). Under ``elastic-trainer
        run`` the worker's entry point reports it; a single process has no torchrun to restart it."""
        if not self._restarted_by_torchrun():
            return False
        return failures.classify(exc)[0] is failures.FailureClass.TRANSIENT

    def _restarted_by_torchrun(self) -> bool:
        """Launched by plain torchrun: a failure's report is this process's to make."""
        return self.env.launched and not failures.ReportTarget.from_environ().launcher_reports

    def _run(self) -> Iterator[Step]:
        if self._observer is None:
            self._observer = build_observer(self.settings)
        if self._group is not None:
            yield from self._attempts(self._group)
        else:
            with ElasticGroup(
                self.settings, self.env, pg_timeout_s=self.config.pg_timeout(self.settings)
            ) as group:
                yield from self._attempts(group)
        self._warn_unsaved()  # a run shorter than the watch's steps
        if self.result is None:
            raise RuntimeError("the elastic loop ended without a result")

    def _attempts(self, group: ElasticGroup) -> Iterator[Step]:
        advice = healing_advice(
            heal_on=self.settings.heal.enabled and self.env.launched,
            group_heals=group.healer is not None,
            own_group=self._group is None,
            sharded=self.state.sharded is not None,
            rebuild=self._rebuild is not None,
        )
        if advice is not None and self.env.is_rank0:
            log.warning("%s", advice)
        try:
            for attempt in group.attempts():
                with attempt:  # a peer's failure is healed here; the next attempt goes on
                    self._start_attempt(attempt)
                    loop = self._loop(attempt)
                    with loop:
                        if loop.state_source == "checkpoint" and loop.resumed_from is not None:
                            self._warn_finished(loop)
                        first = True
                        for plan in loop:
                            step = Step(self, loop, plan)
                            schedule = self._watch_schedule(loop) if first else None
                            try:
                                yield step
                            finally:
                                step.stop_trace()  # the body left the loop after a failure
                            step.reraise()
                            if schedule is not None:
                                self._warn_schedule(schedule, loop)
                            self._steps_run += 1
                            if self._steps_run == state_audit.CHANGE_WINDOW_STEPS:
                                self._warn_unsaved()
                            if first:
                                first = False
                                self._warn_per_rank(group)
                    self._settle_copies()
        finally:
            self._drop_carrier()  # the model reduce-scatters as FSDP does after the run
        self.result = group.result

    # -- the state checks (state_audit.py) ----------------------------------------------------------
    def _watch_unsaved(self, frame: Any) -> None:
        """Rank 0, at the start: the stateful variables of the loop's frame that are not saved,
        and their state now (``state_audit.UnsavedWatch``)."""
        try:
            if frame is None or frame.f_globals.get("__name__", "").startswith(
                "elastic_trainer.train."
            ):
                return  # the Trainer's own loop: it saves what it builds
            namespace = {**frame.f_globals, **frame.f_locals}
        finally:
            del frame  # no reference cycle through the caller's frame
        names = state_audit.unsaved_objects(
            namespace,
            [*self.state.objects.values(), self.state],
            model=self.model,
            ignore=self.ignore_states,
        )
        if names:
            self._unsaved = state_audit.UnsavedWatch({name: namespace[name] for name in names})

    def _loop_namespace(self) -> dict[str, Any]:
        frame = self._loop_frame
        return {**frame.f_globals, **frame.f_locals} if frame is not None else {}

    def _watch_schedule(self, loop: ElasticLoop) -> state_audit.ScheduleWatch | None:
        """At an attempt's first step from a restored state (a resume, a heal): the rates the loop
        finds in its optimizers and its integers (``state_audit.ScheduleWatch``)."""
        if loop.step == 0:
            return None
        rates = state_audit.hand_set_rates(self.state.objects.values())
        if not rates:
            return None
        ints = state_audit.loop_ints(self._loop_namespace())
        return state_audit.ScheduleWatch(rates, ints, loop.step)

    def _warn_schedule(self, watch: state_audit.ScheduleWatch, loop: ElasticLoop) -> None:
        """After that step: a rate that jumped names the loop's own counter (one line; after a
        resume from rank 0, after a heal from each rank it happened on)."""
        rates = state_audit.hand_set_rates(self.state.objects.values())
        message = watch.message(rates, state_audit.loop_ints(self._loop_namespace()))
        if message is not None and (self.env.is_rank0 or loop.state_source != "checkpoint"):
            log.warning("%s", message)

    def _warn_unsaved(self) -> None:
        """Rank 0, once per job start, after the first few steps: the unsaved objects whose
        state changed in them (one line)."""
        watch, self._unsaved = self._unsaved, None
        moved = watch.moved() if watch is not None else {}
        if moved:
            log.warning("%s", state_audit.unsaved_message(moved, rebuilt=self._rebuild is not None))

    def _warn_finished(self, loop: ElasticLoop) -> None:
        """Rank 0: the checkpoint resumed leaves nothing to train (one line, not an error)."""
        if loop.done() and self.env.is_rank0:
            log.warning(
                "%s",
                state_audit.finished_message(
                    loop.checkpoints.last_path, loop.step, max_steps=self.config.max_steps
                ),
            )

    def _warn_per_rank(self, group: ElasticGroup) -> None:
        """Collective, after the first step of each attempt: ``states`` that differ between
        the ranks come back as rank 0's copy after a fault; rank 0 names them in one line."""
        differ = state_audit.differing_states(self._own_states, self.env, waits=group.comms.waits)
        if differ and self.env.is_rank0:
            log.warning("%s", state_audit.per_rank_message(differ))

    def _start_attempt(self, attempt: Attempt) -> None:
        self.env = attempt.env
        self.state.rebind(attempt.env)
        self._ddp = (
            None  # the previous group's DDP goes first (its buckets are as large as the gradients)
        )
        # A failed step may have left partial gradients (a micro-batch's backward under no_sync):
        # the step runs again from its start, so they go (gradients are no state).
        self.model.zero_grad(set_to_none=True)
        self._batches, self._loader_epoch, self._pending_batch = None, -1, None
        self._attempts_started += 1
        if self.state.sharded is not None:
            self._start_sharded(attempt)
            return  # FSDP2 shards and reduces by itself: no wrapper, no buffers to ride
        kwargs, ride = self.ddp_kwargs(self.env)
        if ride:
            self.state.sync_buffers()
        # On the CPU the step's control rides on a gradient DDP reduces anyway (no collective of
        # its own): DDP wraps the model with that parameter (runtime/grad_carrier.py). Decided
        # from this attempt's world, alike on every rank (a survivor and a newcomer too).
        carrier = ControlCarrier.maybe(self.model, self.env, enabled=self.settings.control_carrier)
        module = carrier if carrier is not None else self.model
        self._ddp = attempt.wrap(
            DDP(module, init_sync=attempt.ddp_init_sync, **kwargs),
            self._observer,
            release=self._release_ddp,
        )

    def _start_sharded(self, attempt: Attempt) -> None:
        """A sharded model's attempt: after a heal the model and its optimizers are built again
        on the new group (``rebuild``); the step's control rides on one unit's reduce-scatter
        (``runtime/shard_carrier.py``); the attempt keeps a neighbour copy of this rank's shards
        for a heal in place or for the just-in-time save (:func:`shard_copy_use`,
        ``docs/design/sharded.md``)."""
        # A rebuild needs its own Elastic-made groups: without one, a group failure restarts
        # from the checkpoint. The model's groups died with the last attempt's group.
        if self._rebuild is not None and self._attempts_started > 1:
            with attempt.groups():
                self.state.replace(self._rebuild(attempt.env))
            if not isinstance(self.state.model, nn.Module) or self.state.sharded is None:
                raise failures.ConfigError("rebuild: must return the model, sharded again")
            self.model = self.state.model
        self._drop_carrier()
        self._carrier = ShardCarrier.maybe(
            self.model, self.env, enabled=self.settings.control_carrier
        )
        attempt.carry(self._carrier)
        sharded = self.state.sharded
        if sharded is None:
            return
        config = (
            self.config.shard_copy
            if self.config.shard_copy is not None
            else NeighbourCopyConfig.from_environ()
        )
        jit = self.config.checkpoint.jit_save
        use = shard_copy_use(
            heals=self._rebuild is not None and attempt.group.healer is not None,
            every=config.every,
            world_size=self.env.world_size,
            saves_just_in_time=self.config.checkpoint.directory is not None
            and (jit if jit is not None else self.settings.jit_save),
            one_dim=sharded.replicas == 1,
        )
        if use == "heal":  # held by the attempt: the healer restores each shard from it
            # HSDP: the replicas of a shard are its copies (nothing is sent).
            replicas = max(1, sharded.replicas)
            copies = attempt.copy_shards(sharded.local_state, every=config.every, replicas=replicas)
        elif use == "save":  # for the just-in-time save only: no healer holds it
            copies = NeighbourCopy(
                sharded.local_state, env=self.env, every=config.every, group=attempt.host_group()
            )
        else:
            return
        self.state.keep_copies(copies, heals=use == "heal")

    def _settle_copies(self) -> None:
        """(The loop ended) a copy kept for the just-in-time save only ends its last exchange
        before the process group goes (a healer's host group is aborted instead)."""
        copies = self.state.copies
        if copies is None or self.state.heal_in_place:
            return
        try:
            copies.wait()
        except Exception as exc:  # noqa: BLE001 - the run is over; its checkpoints stand
            log.warning(
                "the neighbour copy's last exchange failed after the run ended: %s",
                failures.log_line(exc),
            )

    def _drop_carrier(self) -> None:
        """The last attempt's sharded model gets its own reduce-scatter back."""
        carrier, self._carrier = self._carrier, None
        if carrier is not None:
            carrier.close()

    def no_sync(self) -> Any:
        """A context in which backward accumulates gradients without reducing them (DDP's
        ``no_sync``; FSDP2's ``set_requires_gradient_sync(False)``)."""
        if self.state.sharded is not None:
            return no_gradient_sync(self.model)
        if self._ddp is None:
            raise RuntimeError("the model has no DDP in this attempt")
        return self._ddp.no_sync()

    def ddp_kwargs(self, env: DistEnv) -> tuple[dict[str, Any], bool]:
        """DDP's keyword arguments in ``env``, and whether rank 0's buffers ride on the step's
        control allreduce instead of DDP's forward-time broadcast. They ride on the CPU only: on
        CUDA the buffers' allreduce makes the host wait for the device before the update
        (``docs/design/steady-state.md``), which DDP's broadcast does not."""
        kwargs = dict(self.ddp_options)
        broadcast = bool(kwargs.pop("broadcast_buffers", kwargs.pop("forward_sync_buffers", True)))
        ride = (
            broadcast
            and env.world_size > 1
            and env.device.type == "cpu"
            and replaces_buffer_broadcast(self.model)
        )
        # torch >= 2.13 calls forward-time buffer broadcasting ``forward_sync_buffers`` (buffers are
        # then always synced once at construction, which resume relies on anyway).
        forward_sync = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
        kwargs["forward_sync_buffers" if forward_sync else "broadcast_buffers"] = (
            broadcast and not ride
        )
        if env.device.type == "cuda":
            kwargs.setdefault("device_ids", [env.device.index])
            kwargs.setdefault("output_device", env.device.index)
        return kwargs, ride

    def _release_ddp(self) -> None:
        self._ddp = None

    def _loop(self, attempt: Attempt) -> ElasticLoop:
        # A sharded checkpoint's own group is aborted with the training group at a heal: an
        # asynchronous write under way on it ends at once (and is never committed).
        with attempt.groups() if self.state.sharded is not None else NOTHING:
            checkpoints = CheckpointManager(
                self.config.checkpoint,
                env=self.env,
                state=self.state,
                fingerprint=self.fingerprint,
                settings=self.settings,
                observer=self._observer,
                fence=attempt.fence,
                run_config=self.run_config,
            )
        self._earlier_loss = self.reported_loss  # a new attempt's loop has none yet
        self.loop = attempt.loop(
            sampler=self.sampler,
            checkpoints=checkpoints,
            max_steps=self.config.max_steps,
            epochs=self.config.epochs,
            seed=self.config.seed,
            observer=self._observer,
            settings=self.settings,
            sigterm_grace_s=self.config.sigterm_grace(self.settings),
            log_every=self.config.log_every,
            record_samples_dir=self.config.record_samples_dir,
            tokens_per_sample=self.tokens_per_sample,
            lr=self._lr,
            after_step=self.after_step,
            fault_hook=self._fault_hook,
        )
        return self.loop

    def _lr(self) -> float | None:
        optimizer = self.state.objects.get("optimizer")
        groups = getattr(optimizer, "param_groups", None)
        lr = groups[0].get("lr") if groups else None
        return lr if isinstance(lr, float) else None  # a tensor lr would synchronise

    def _next_batch(self, plan: StepPlan) -> Any:
        """The next micro-batch of this rank, from a DataLoader over the sampler (one per epoch and
        attempt, created at the current cursor with its own generator: the global RNG stays put)."""
        if self._pending_batch is not None:
            batch, self._pending_batch = self._pending_batch, None
            return batch
        if self.dataset is None:
            raise RuntimeError("no dataset to load from")
        if self._batches is None or self._loader_epoch != plan.epoch:
            env = self.env
            generator = torch.Generator().manual_seed(
                rng.derive_seed(self.config.seed, plan.epoch, plan.cursor, env.rank, env.world_size)
            )
            loader = DataLoader(
                self.dataset,
                batch_sampler=MicroBatchSampler(self.sampler, env.rank, env.world_size),
                num_workers=self.config.num_workers,
                collate_fn=self.collate_fn,
                pin_memory=env.device.type == "cuda",
                generator=generator,
            )
            self._batches, self._loader_epoch = iter(loader), plan.epoch
        return move_to(next(self._batches), self.env.device)

    def peek_batch(self, plan: StepPlan) -> Any:
        """The step's next micro-batch, left to be loaded again by ``for batch in step`` (DDP's
        bucket priming runs on it first)."""
        batch = self._next_batch(plan)
        self._pending_batch = batch
        return batch


class Step:
    """One optimizer step of an :class:`Elastic` run; see the module docstring."""

    def __init__(self, elastic: Elastic, loop: ElasticLoop, plan: StepPlan) -> None:
        self._elastic = elastic
        self._loop = loop
        self.plan = plan
        """This rank's share of the step (epoch, cursor, micro-batches with their indices)."""
        self.number = loop.step + 1
        """The step this is (1 for the first optimizer step of the job)."""
        self._completed = False
        self._after: AfterFailureTrace | None = None
        self._index: int | None = None
        self._loss_sum: torch.Tensor | None = None
        self._update: Any = None
        self._failure: BaseException | None = None

    @property
    def completed(self) -> bool:
        """The step's update was applied: False after a failure that ``with step:`` took, when the
        code after it runs for the failed attempt (put that code under ``if step.completed:``)."""
        if self._after is not None:
            self._after.guarded = True
        return self._completed

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    @property
    def weight(self) -> float:
        """The current micro-batch's loss weight: its samples x the world size / the step's
        samples. DDP averages gradients over the ranks, so ``loss * weight`` gives the gradient of
        the mean loss over the global batch at any world size, however unevenly it is split (a
        padding micro-batch weighs 0). It is no loss to log: :attr:`Elastic.reported_loss` is."""
        micro = self.plan.micro_batches[self._current()]
        return micro.samples * (self._loop.env.world_size / self.plan.global_samples)

    def _current(self) -> int:
        if self._index is None:
            raise RuntimeError("no micro-batch in progress: call this inside `for batch in step`")
        return self._index

    def __iter__(self) -> Iterator[Any]:
        """This rank's micro-batches: loaded (a dataset was given) or as :class:`MicroBatch`
        indices; all but the last under ``no_sync`` (:meth:`Elastic.no_sync`)."""
        elastic, loop = self._elastic, self._loop
        micro_batches = self.plan.micro_batches
        last = len(micro_batches) - 1
        for i, micro in enumerate(micro_batches):
            self._index = i
            item: Any = micro
            if elastic.dataset is not None:
                started = time.monotonic()
                item = elastic._next_batch(self.plan)
                loop.add_data_wait(time.monotonic() - started)
                if loop.tokens_per_sample == 0:  # token ids: tokens/s without tokens_per_sample
                    loop.tokens_per_sample = tokens_per_sample_of(item)
            with elastic.no_sync() if i < last else NOTHING:
                yield item
        self._index = None

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for the current micro-batch (scaled by the run's GradScaler, if
        any). ``loss`` is the micro-batch's mean loss times :attr:`weight`. The last micro-batch
        starts the step's control allreduce first (global loss, stop flag), so that it overlaps
        the backward, and opens the update section after it."""
        index = self._current()
        plan, env = self.plan, self._loop.env
        contribution = loss.detach().float() * (
            plan.global_samples / env.world_size
        )  # loss x samples
        self._loss_sum = contribution if self._loss_sum is None else self._loss_sum + contribution
        last = index == len(plan.micro_batches) - 1
        if last:
            self._loop.start_control(self._loss_sum)
        scaler = self._elastic.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if last:
            self._open_update()

    def _open_update(self) -> None:
        if self._update is None:
            self._update = self._loop.update()
            self._update.__enter__()

    def __enter__(self) -> Step:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            if exc is None:
                self._open_update()
            if self._update is not None:
                self._update.__exit__(exc_type, exc, tb)
        except BaseException as raised:  # noqa: BLE001 - a failure of the update itself, healed alike
            exc = raised
        if exc is None:
            self._completed = True
            return False
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: as they are
        # Handed to the run (its next iteration raises it where the loop and the heal see it):
        # a peer's failure heals in place, anything else ends the run as it would have.
        self._failure = exc
        redone = failures.classify(exc)[0] is failures.FailureClass.TRANSIENT  # else the run ends
        if redone and not self._elastic._warned_after_failure:
            self._after = AfterFailureTrace(sys._getframe(1))  # until the run takes the failure
        return True

    def stop_trace(self) -> None:
        """End the trace of the code after a failed ``with step:``; name that code once per
        process (:mod:`elastic_trainer.train.after_failure`)."""
        after, self._after = self._after, None
        ran = after.stop() if after is not None else None
        if ran is not None and not self._elastic._warned_after_failure:
            self._elastic._warned_after_failure = True
            log.warning("%s", after_failure_message(self.number, ran))

    def reraise(self) -> None:
        """(The run, after the body) raise the failure ``with step:`` took, if any."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if not self._completed:
            raise RuntimeError(f"step {self.number}: the loop body must run inside `with step:`")


__all__ = ["Elastic", "MicroBatch", "Step"]
