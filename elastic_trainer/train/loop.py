"""Your own training loop, elastic: the runtime's duties around it, in one object.

    with ElasticLoop(env=env, sampler=sampler, checkpoints=manager, max_steps=1000) as loop:
        for plan in loop:                       # resumes first; yields this rank's share of each step
            loss = train_step(plan.indices)     # forward and backward, your way
            with loop.update(loss=loss):        # optimizer, scheduler: the update section
                optimizer.step()
                scheduler.step()
    result = loop.result                        # finished, or stopped for a restart (exit with its code)

What the loop does for the body: it loads the newest checkpoint before the first step (rank 0
chooses, every rank loads onto its device); reseeds every rank's random generators at each step
from ``(seed, rank, step)`` (exact resume, dropout included); hands out each step's samples from
the elastic sampler (exactly once per epoch at any world size); runs one small control allreduce
per step (the global loss and the stop flag, and rank 0's buffers for the just-in-time save); on
SIGTERM makes every rank stop after the same step and checkpoints it; writes periodic checkpoints;
and when the body raises, saves the last completed step just in time (any surviving rank) before
the exception ends the process. Metrics go to the observer.

What the body must do: apply every change of the training state (optimizer, scheduler, anything
that is saved) inside ``with loop.update(...)``, exactly once per step, and nothing of it outside.
The loop advances the sampler and the step count there. Between steps (after the update) it may
evaluate, log or call collectives: the next step reseeds its random numbers anyway.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.checkpoint.manager import CheckpointManager
from elastic_trainer.runtime import failures, heartbeat, rng
from elastic_trainer.runtime.comms import WorkerComms
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.exit_codes import EXIT_STOPPED
from elastic_trainer.runtime.observer import NullObserver, TrainingObserver
from elastic_trainer.runtime.sample_log import SampleLog
from elastic_trainer.runtime.sampler import ElasticSampler, StepPlan
from elastic_trainer.runtime.settings import WorkerSettings
from elastic_trainer.runtime.signals import GracefulStop, SignalWakeup
from elastic_trainer.runtime.step_control import (
    Carrier,
    ControlChannel,
    ControlResult,
    PendingControl,
)
from elastic_trainer.train.diagnostics import Diagnostics
from elastic_trainer.train.replica_check import ReplicaCheck

log = logging.getLogger(__name__)


FaultHook = Callable[[str, int], None]
"""Test seam: ``hook(point, step)`` at ``"before_control"`` and ``"after_update"`` of every step."""


@dataclass(frozen=True, slots=True)
class TrainResult:
    """How a run of the loop ended."""

    step: int
    epoch: int
    loss: float | None
    """Mean loss over the global batch of the last reported step."""
    resumed_from: int | None
    """Step of the checkpoint this run started from."""
    stopped_by_signal: bool
    """A rank received SIGTERM/SIGINT; every rank stopped after the same step."""
    checkpoint: str | None
    """The last checkpoint written (rank 0 only)."""

    @property
    def finished(self) -> bool:
        """Training reached its end. ``False``: this process was stopped (scale-down, preemption, a
        new member): do not run end-of-training code, exit with :attr:`exit_code` and let torchrun
        restart the group."""
        return not self.stopped_by_signal

    @property
    def exit_code(self) -> int:
        return EXIT_STOPPED if self.stopped_by_signal else 0


def total_steps(steps_per_epoch: int, *, epochs: int | None, max_steps: int | None) -> int:
    """Steps a job trains for: ``max_steps`` or ``epochs`` passes, whichever comes first."""
    if epochs is None:
        return max_steps if max_steps is not None else steps_per_epoch
    total = epochs * steps_per_epoch
    return total if max_steps is None else min(total, max_steps)


_SAMPLER_PROTOCOL = ("plans", "advance", "set_epoch", "epoch_done", "state_dict", "load_state_dict")


def check_sampler(sampler: object) -> None:
    """Refuse, before the first step, a sampler that cannot re-split a step over a new world size.

    Raises:
        ConfigError: ``sampler`` lacks the elastic sampler's protocol (a ``DistributedSampler``).
    """
    missing = [name for name in _SAMPLER_PROTOCOL if not hasattr(sampler, name)]
    if missing:
        raise failures.ConfigError(
            f"the sampler is a {type(sampler).__name__}, not an elastic one (it has no {missing[0]}()): use "
            "elastic_trainer.ElasticSampler(len(dataset), global_batch_size, seed=...), which re-splits every step "
            "over the ranks alive, so that each sample is trained once per epoch at any world size"
        )


def ensure_progress_logging(rank: int) -> None:
    """Show the runtime's progress lines (INFO) when the program configured no logging at all.

    A program that set up logging (any handler on the root logger or on ``elastic_trainer``) keeps
    its own configuration.
    """
    package = logging.getLogger("elastic_trainer")
    if logging.getLogger().handlers or package.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    )
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)


class ElasticLoop:
    """Drives one worker's training loop; see the module docstring.

    Args:
        env: this worker's place in the job (its process group must exist).
        sampler: the elastic sampler (also saved and restored by ``checkpoints``).
        checkpoints: the checkpoint manager.
        max_steps: stop after this many steps in total; ``None``: all ``epochs``.
        epochs: passes over the dataset; ``None``: as many as ``max_steps`` takes (one without
            ``max_steps``).
        seed: the job's seed (every step's random numbers derive from it).
        observer: metrics; default none.
        settings: the worker's environment settings; parsed when omitted.
        sigterm_grace_s: seconds from SIGTERM to exit; default the settings'.
        log_every: rank 0 logs a progress line every this many steps.
        record_samples_dir: audit: every rank records every step's dataset indices there.
        tokens_per_sample: for the observer's token counts.
        lr: returns the learning rate to report (a Python float; a tensor would synchronise).
        after_step: called with the step number after each step, on every rank.
        fault_hook: test seam (:data:`FaultHook`).
        heals_in_place: a failed collective is healed by the caller (:mod:`elastic_trainer.heal`):
            the loop then neither saves just in time nor arms the exit deadline for it, and keeps
            rank 0's buffers of every step so that this rank can hand its state to peers.
        initial_state: start from this state (a peer's, after a heal) instead of the newest
            checkpoint.
        heal_check: called at the start of every step; raises to stop the step when the group
            is being healed (``Healer.check``).
        generation_part: how many times this process healed before (names its sample log).
        control_carrier: the model's :class:`~elastic_trainer.runtime.step_control.Carrier` (the
            default on the CPU: DDP's gradient, or an FSDP unit's reduce-scatter): the control
            rides on it when :meth:`start_control` is called before the synchronised backward,
            and goes on its own collective otherwise.
        comms: the worker's runtime context (abortable waits); default a plain one.
    """

    def __init__(
        self,
        *,
        env: DistEnv,
        sampler: ElasticSampler,
        checkpoints: CheckpointManager,
        max_steps: int | None = None,
        epochs: int | None = None,
        seed: int = 0,
        observer: TrainingObserver | None = None,
        settings: WorkerSettings | None = None,
        sigterm_grace_s: float | None = None,
        log_every: int = 10,
        record_samples_dir: str | None = None,
        tokens_per_sample: int = 0,
        lr: Callable[[], float | None] | None = None,
        after_step: Sequence[Callable[[int], None]] = (),
        fault_hook: FaultHook | None = None,
        heals_in_place: bool = False,
        initial_state: dict[str, Any] | None = None,
        generation_part: int = 0,
        heal_check: Callable[[], None] | None = None,
        control_carrier: Carrier | None = None,
        comms: WorkerComms | None = None,
        diagnostics: Diagnostics | None = None,
    ) -> None:
        self.env = env
        check_sampler(sampler)
        self.sampler = sampler
        self.checkpoints = checkpoints
        self.state = checkpoints.state
        """What is saved, restored and handed to peers (the checkpoint manager's)."""
        self.max_steps = max_steps
        self.epochs = epochs if epochs is not None else (1 if max_steps is None else None)
        """Passes over the dataset; ``None``: until ``max_steps``."""
        self.seed = seed
        self.observer: TrainingObserver = observer if observer is not None else NullObserver()
        settings = settings if settings is not None else WorkerSettings.from_environ()
        self._receive_stop(settings, sigterm_grace_s)
        self._replicas = ReplicaCheck(self.state, env, every=settings.replica_check_every)
        self.log_every = log_every
        self.record_samples_dir = record_samples_dir
        self.tokens_per_sample = tokens_per_sample
        self._lr = lr or (lambda: None)
        self._after_step = list(after_step)
        self._fault = fault_hook
        self.heals_in_place = heals_in_place and self.state.heal_in_place
        """A failed collective is healed by the caller: the group heals in place and the state
        can be handed on by a peer (``TrainingState.heal_in_place``)."""
        self._heal_check = heal_check
        self._carrier = control_carrier
        self._comms = comms if comms is not None else WorkerComms()
        self._diagnostics = diagnostics
        self._profiler = diagnostics.profiler if diagnostics is not None else None
        self._start_run(initial_state, generation_part)

    def _receive_stop(self, settings: WorkerSettings, grace_s: float | None) -> None:
        """A stop signal's two receivers: the graceful stop (every rank stops after the same
        step, within ``grace_s``, default the settings'), and the wakeup that tells the
        just-in-time save at once, even while this thread is blocked in a collective."""
        self._stop = GracefulStop(grace_s if grace_s is not None else settings.sigterm_grace_s)
        self._jit = self.checkpoints.just_in_time
        self._wakeup = SignalWakeup(self._jit.on_signal)

    def _start_run(self, initial_state: dict[str, Any] | None, generation_part: int) -> None:
        """What the run records as it goes: where its state comes from (``initial_state``: a
        peer's), the steps in flight and their reports (a sample log's part: ``generation_part``),
        the result."""
        self._initial_state = initial_state
        self._generation_part = generation_part
        self._watch: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        self.state_ready = False
        """The state is this run's (loaded or taken from a peer): this rank may serve it."""
        self.state_source = "checkpoint"
        """Where the state came from: ``checkpoint`` (or a fresh start) or ``peer``."""
        self._resumed_from: int | None = None
        self._channel: ControlChannel | None = None  # created in __enter__, collectively
        self._sample_log: SampleLog | None = None
        self._plan: StepPlan | None = None
        self._control: PendingControl | None = None
        self._pending: PendingControl | None = None
        self._updated = False
        self._started_at = 0.0
        self._data_wait = 0.0
        self._durations: dict[int, tuple[float, float, StepPlan, float | None]] = {}
        self._step_lr: float | None = None
        self._window = (time.monotonic(), 0)
        self.loss: float | None = None
        self.loss_step: int | None = None
        """The step :attr:`loss` belongs to (it arrives on a later step's control)."""
        self.result: TrainResult | None = None

    # -- properties ---------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self.state.step

    @property
    def resumed_from(self) -> int | None:
        """The step this attempt started from (``None``: from scratch)."""
        return self._resumed_from

    @property
    def total_steps(self) -> int:
        """Steps the job trains for in all: ``max_steps`` or ``epochs`` x steps per epoch
        (``ceil(dataset size / global batch)``), whichever comes first."""
        return total_steps(len(self.sampler), epochs=self.epochs, max_steps=self.max_steps)

    @property
    def stop_requested(self) -> bool:
        """This rank received a stop signal (every rank agrees on it a step later at most)."""
        return self._stop.requested

    def done(self) -> bool:
        if self.max_steps is not None and self.step >= self.max_steps:
            return True
        return self.epochs is not None and self.sampler.epoch >= self.epochs

    # -- the context --------------------------------------------------------------------------------
    def __enter__(self) -> ElasticLoop:
        ensure_progress_logging(self.env.rank)
        self._stop.install()
        self._wakeup.install()
        self._watch = self.state.watch()
        self._watch.__enter__()
        try:
            self._channel = ControlChannel(self.env, waits=self._comms.waits, carrier=self._carrier)
            if self.heals_in_place:
                self.state.serve_peers()
            if self._initial_state is not None:
                # A peer's payload; sharded: this rank's shards, else the newest checkpoint.
                self._resumed_from = self.checkpoints.load(self._initial_state)
                self._initial_state, self.state_source = None, "peer"
                # Every member restored the same payload: one small allreduce proves they hold
                # the same state (a load_state_dict that restores less than it saves would not).
                self.state.verify_replicas()
            else:
                self._resumed_from = self.checkpoints.load()
            self.state_ready = True
            self._replicas.started(self.step)
            self.sampler_check()
            self._open_sample_log()
            self.observer.on_start(
                world_size=self.env.world_size,
                restart_count=self.env.restart_count,
                total_steps=self.total_steps,
            )
        except BaseException:
            self._teardown()
            raise
        return self

    def sampler_check(self) -> None:
        """The manager restored the sampler it saves: the loop must drive the same object."""
        saved = self.state.objects.get("sampler")
        if saved is not None and saved is not self.sampler:
            raise ValueError(
                "checkpoints must save the loop's sampler (states['sampler'] is another object)"
            )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if isinstance(exc, Exception) and not (
                self.heals_in_place and failures.is_collective_failure(exc)
            ):
                failures.note_step(exc, self.step + 1)  # the launcher's repeat check compares steps
                if self._diagnostics is not None and failures.is_collective_failure(exc):
                    self._diagnostics.keep_restart(self.checkpoints.directory, self.env, exc)
                self._jit.after_failure(exc)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        try:
            self.checkpoints.close(self._stop.grace_s)
        finally:
            self._watch.__exit__(None, None, None)
            self._wakeup.uninstall()
            self._stop.uninstall()
            if self._sample_log is not None:
                self._sample_log.close()

    def _open_sample_log(self) -> None:
        if self.record_samples_dir is None:
            return
        generation = [(uuid.uuid4().hex, time.time())]
        if self.env.world_size > 1:
            dist.broadcast_object_list(generation, src=0)
        self._sample_log = SampleLog(
            self.record_samples_dir, rank=self.env.rank, part=self._generation_part
        )
        self._sample_log.start(
            generation=generation[0][0],
            started_unix=generation[0][1],
            resumed_step=self.step,
            world_size=self.env.world_size,
            rank=self.env.rank,
            source=self.state_source,
        )

    # -- the steps ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[StepPlan]:
        """This rank's share of each step, until the job is done or every rank agreed to stop."""
        env = self.env
        self._jit.arm(lambda: self._stop.deadline)
        while not self.done():
            if self.sampler.epoch_done:
                with self.state.guard.update():
                    self.sampler.set_epoch(self.sampler.epoch + 1)
                continue
            for plan in self.sampler.plans(env.rank, env.world_size):
                if self.done():
                    break
                self._begin(plan)
                yield plan
                if not self._updated:
                    raise RuntimeError(
                        f"step {self.step + 1}: the loop body must apply its update inside "
                        "`with loop.update(...)`"
                    )
                if self._after_update(plan):
                    return
        self._end()

    def _begin(self, plan: StepPlan) -> None:
        env = self.env
        if self._heal_check is not None:
            self._heal_check()
        if self._profiler is not None:
            self._profiler.tick()
        self._plan, self._control, self._updated = plan, None, False
        self._started_at = time.monotonic()
        self._data_wait = 0.0
        # Every step's random numbers are a function of (seed, rank, step): exact resume needs no
        # generator state, not even the dead rank's (see elastic_trainer.runtime.rng).
        rng.seed_step(self.seed, env.rank, self.step, env.device)
        if self._sample_log is not None:
            # Written before the step can commit anywhere (no rank can finish its update before this
            # rank joined the step's collectives), so a committed step always has every rank's record.
            self._sample_log.step(
                step=self.step + 1,
                epoch=plan.epoch,
                cursor=plan.cursor,
                world_size=env.world_size,
                rank=env.rank,
                indices=plan.indices,
            )

    def add_data_wait(self, seconds: float) -> None:
        """Time the body spent waiting for its data in this step (reported to the observer)."""
        self._data_wait += seconds

    def _channel_(self) -> ControlChannel:
        if self._channel is None:
            raise RuntimeError("the loop is used outside `with loop:`")
        return self._channel

    def start_control(self, loss_sum: torch.Tensor | None) -> None:
        """Start this step's control allreduce now (after the last forward, so that it overlaps the
        backward). ``loss_sum``: this rank's loss summed over its samples of the step. Optional:
        :meth:`update` starts it otherwise."""
        plan = self._current_plan()
        if self._control is not None:
            raise RuntimeError(f"step {self.step + 1}: the control allreduce was started twice")
        if self._fault is not None:
            self._fault("before_control", self.step + 1)
        buffers = self.state.buffers.capture() if self.state.buffers is not None else None
        self._control = self._channel_().start(
            self.step + 1,
            loss_sum,
            global_samples=plan.global_samples,
            stop=self._stop.requested,
            buffers=buffers,
            checkpoint_failed=self.checkpoints.write_failed,
            checksum=self._replicas.take(),
        )

    @contextlib.contextmanager
    def update(self, loss: torch.Tensor | None = None) -> Iterator[None]:
        """The update section of the current step: apply the optimizer step (and everything else
        that changes the saved state) inside it.

        ``loss``: this rank's mean loss over its samples of the step, for the global loss (if
        :meth:`start_control` was not called).
        """
        plan = self._current_plan()
        if self._updated:
            raise RuntimeError(f"step {self.step + 1}: one update per step")
        if self._control is None:
            self.start_control(loss.detach().float() * plan.samples if loss is not None else None)
        control = self._control
        if control is None:
            raise RuntimeError("no control allreduce for this step")
        self._channel_().wait_before_update(control)
        self._step_lr = (
            self._lr()
        )  # the step's own: a scheduler stepped in the update sets the next one's
        with self.state.update(
            self.step + 1, buffers=control.buffers if control.complete else None
        ):
            yield
            self.sampler.advance(plan)
        self._updated = True

    def _current_plan(self) -> StepPlan:
        if self._plan is None:
            raise RuntimeError("no step in progress: call this inside `for plan in loop`")
        return self._plan

    def _after_update(self, plan: StepPlan) -> bool:
        """Bookkeeping after a step's update; True when every rank agreed to stop (and it was
        checkpointed)."""
        step = self.step
        if self._fault is not None:
            self._fault("after_update", step)
        self._durations[step] = (
            time.monotonic() - self._started_at,
            self._data_wait,
            plan,
            self._step_lr,
        )
        self._replicas.after_update(step)
        self.state.guard.boundary()  # a step ended (the just-in-time save's stall detection)
        heartbeat.note_step(step)  # the launcher's frozen-worker watchdog learns the step times
        if self._sample_log is not None:
            self._sample_log.done(step=step)
        control = self._control
        self._plan = None
        # A step is reported (loss, stop flag) once its control allreduce is in: usually it overlaps
        # the next step and is read then; when the update waited for it, it is read now and a stop
        # ends the run one step earlier. Either way every rank reads the same flag after the same step.
        stop = self._report(self._pending) if self._pending is not None else False
        if control is not None and control.complete:
            stop = self._report(control) or stop
            self._pending = None
        else:
            self._pending = control
        if stop:
            self._end(stopped=True)
            return True
        self.checkpoints.save(step)  # when due
        for callback in self._after_step:
            callback(step)
        return False

    def _report(self, pending: PendingControl) -> bool:
        """Read a finished control: report the step whose loss it carried; True when every rank
        agreed to stop."""
        result: ControlResult = self._channel_().finish(pending)
        if result.checkpoint_failed:
            self.checkpoints.raise_write_failure()
        self._replicas.compared(result)
        if result.loss_step is not None:
            self._report_step(result.loss_step, result.loss)
        return result.stop

    def _report_step(self, step: int, loss: float | None) -> None:
        if loss is not None:
            self.loss, self.loss_step = loss, step
        duration, data_wait, plan, lr = self._durations.pop(step, (0.0, 0.0, None, None))
        samples = plan.samples if plan is not None else 0
        self.observer.on_step(
            step=step,
            duration_s=duration,
            data_wait_s=data_wait,
            samples=samples,
            tokens=samples * self.tokens_per_sample,
            loss=loss,
            lr=lr,
        )
        start, window_samples = self._window
        window_samples += plan.global_samples if plan is not None else 0
        if self.env.is_rank0 and step % self.log_every == 0:
            now = time.monotonic()
            log.info(
                "step %d epoch %d loss %s samples/s %.1f world %d lr %s",
                step,
                self.sampler.epoch,
                "n/a" if loss is None else f"{loss:.4f}",
                window_samples / max(now - start, 1e-9),
                self.env.world_size,
                "n/a" if lr is None else f"{lr:.3g}",
            )
            start, window_samples = now, 0
        self._window = (start, window_samples)

    def _flush(self) -> None:
        """Every rank, at the same point (the end, or an agreed stop): one more control that
        carries the last step's loss, so every step is reported."""
        if self._pending is not None:
            self._report(self._pending)
            self._pending = None
        if self._durations:
            self._report(self._channel_().start(self.step, None, global_samples=0, stop=False))

    def _end(self, *, stopped: bool = False) -> None:
        """Every rank, after the same step: the end of training, or a stop every rank agreed on
        (the graceful path then owns the exit): the last reports, the final checkpoint, the
        result."""
        self._jit.stand_down()
        self._flush()
        if stopped:
            log.warning(
                "stopping after step %d (signal on %s)",
                self.step,
                "this rank" if self._stop.requested else "another rank",
            )
        path = self.checkpoints.save(self.step, final=True)
        if self.env.is_rank0 and not stopped:
            log.info(
                "training finished at step %d (epoch %d), loss %s",
                self.step,
                self.sampler.epoch,
                "n/a" if self.loss is None or math.isnan(self.loss) else f"{self.loss:.6f}",
            )
        self.result = TrainResult(
            step=self.step,
            epoch=self.sampler.epoch,
            loss=self.loss,
            resumed_from=self.resumed_from,
            stopped_by_signal=stopped,
            checkpoint=path,
        )
