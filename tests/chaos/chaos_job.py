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
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from elastic_trainer.examples import synthetic_cnn as example
from elastic_trainer.trainer import TrainingJob

SLOW_MS_ENV = "CHAOS_SLOW_MS"
SLOW_STEPS_ENV = "CHAOS_SLOW_STEPS"


def slowed_loss(loss: Callable[[Any, Any], torch.Tensor], *, delay_s: float, steps: int) -> Callable[[Any, Any], torch.Tensor]:
    """``loss`` that sleeps ``delay_s`` in each of its first ``steps`` calls (one call per step
    when there is no micro-batching, as in the chaos jobs)."""
    calls = 0

    def slow(output: Any, target: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls <= steps:
            time.sleep(delay_s)
        return loss(output, target)

    return slow


def make_job(args: argparse.Namespace, original: Callable[[argparse.Namespace], TrainingJob] = example.make_job) -> TrainingJob:
    """The example's job with this node's hooks applied."""
    job = original(args)
    slow_ms = float(os.environ.get(SLOW_MS_ENV, "0") or 0)
    if slow_ms > 0:
        steps = int(os.environ.get(SLOW_STEPS_ENV, "1000000000"))
        job = dataclasses.replace(job, loss=slowed_loss(job.loss, delay_s=slow_ms / 1000, steps=steps))
    return job


if __name__ == "__main__":
    example.make_job = make_job  # the example's main() looks its factory up at call time
    example._exit(example.main())
