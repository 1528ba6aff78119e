"""The example job (``elastic_trainer.examples.synthetic_cnn``) with the chaos suite's fault hooks.

Every node of a chaos scenario runs it as a script under the real launcher::

    elastic-trainer run --nnodes 1:2 ... tests/chaos/chaos_job.py --dataset-size 384 ...

It takes the example's own arguments and trains exactly as the example does; the hooks change
timing only, never the math, so a run with hooks gives the same weights as one without.

Hooks (environment variables of one node, so one node can misbehave while the others do not):

``CHAOS_SLOW_MS`` and ``CHAOS_SLOW_STEPS``
    A straggler: each rank of this node sleeps ``CHAOS_SLOW_MS`` milliseconds inside the forward
    pass (in the loss, so that the time counts as the rank's compute, as a slow GPU's would) in
    each of its first ``CHAOS_SLOW_STEPS`` steps, then runs at full speed.
``CHAOS_EXIT_BEFORE_STEP``
    Each rank of this node exits (code 0) as it starts computing that step, after the previous
    step and its checkpoint are complete. With ``--checkpoint-every 1`` a run thus ends at an exact
    step: the suite replays a faulty run's world-size changes at the same steps without faults
    (see :mod:`tests.chaos.invariants`). (SIGTERM cannot do this: the runtime may take one more
    step before it stops.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from elastic_trainer.examples import synthetic_cnn as example
from elastic_trainer.runtime.observer import TrainingObserver
from elastic_trainer.train.trainer import TrainingJob

SLOW_MS_ENV = "CHAOS_SLOW_MS"
SLOW_STEPS_ENV = "CHAOS_SLOW_STEPS"
EXIT_BEFORE_STEP_ENV = "CHAOS_EXIT_BEFORE_STEP"


class Progress:
    """Where this rank is: the step it resumed from and the loss calls since (one per step)."""

    def __init__(self) -> None:
        self.resumed = 0
        self.calls = 0

    @property
    def current_step(self) -> int:
        """The step being computed during a loss call."""
        return self.resumed + self.calls


class ResumeObserver:
    """Wraps the runtime's observer to learn the step a worker resumed from."""

    def __init__(self, inner: TrainingObserver, progress: Progress) -> None:
        self._inner = inner
        self._progress = progress

    def on_checkpoint_loaded(self, **kwargs: Any) -> None:
        self._progress.resumed = kwargs["step"]
        self._inner.on_checkpoint_loaded(**kwargs)

    def on_priming(self, *, backward_passes: int) -> None:
        # DDP bucket priming after a resume called the loss without being a step: without this,
        # CHAOS_EXIT_BEFORE_STEP ended a resumed run one step early (seed 31, 50 faults).
        self._progress.calls -= backward_passes
        on_priming = getattr(self._inner, "on_priming", None)
        if on_priming is not None:
            on_priming(backward_passes=backward_passes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def hooked_loss(loss: Callable[[Any, Any], torch.Tensor], progress: Progress, *, slow_s: float, slow_steps: int,
                exit_before: int | None) -> Callable[[Any, Any], torch.Tensor]:
    """``loss`` with the hooks of the module docstring (one loss call per step: no micro-batching;
    the priming passes after a resume are taken back by :meth:`ResumeObserver.on_priming`)."""

    def hooked(output: Any, target: Any) -> torch.Tensor:
        progress.calls += 1
        if progress.calls <= slow_steps:
            time.sleep(slow_s)
        if exit_before is not None and progress.current_step >= exit_before:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return loss(output, target)

    return hooked


PROGRESS = Progress()


def make_job(args: argparse.Namespace, original: Callable[[argparse.Namespace], TrainingJob] = example.make_job) -> TrainingJob:
    """The example's job with this node's hooks applied."""
    job = original(args)
    slow_ms = float(os.environ.get(SLOW_MS_ENV, "0") or 0)
    exit_before = os.environ.get(EXIT_BEFORE_STEP_ENV)
    if slow_ms <= 0 and exit_before is None:
        return job
    loss = hooked_loss(job.loss, PROGRESS, slow_s=slow_ms / 1000,
                       slow_steps=int(os.environ.get(SLOW_STEPS_ENV, "1000000000")) if slow_ms > 0 else 0,
                       exit_before=int(exit_before) if exit_before else None)
    return dataclasses.replace(job, loss=loss)


def build_observer(original: Callable[[], TrainingObserver] = example.build_observer) -> TrainingObserver:
    return ResumeObserver(original(), PROGRESS)  # type: ignore[return-value]


if __name__ == "__main__":
    # The example's main() looks both factories up at call time.
    example.make_job = make_job
    example.build_observer = build_observer
    example._exit(example.main())
