"""The example job (``elastic_trainer.examples.synthetic_cnn``) with the chaos suite's fault hooks.

Every node of a chaos scenario runs it as a script under the real launcher::

    elastic-trainer run --nnodes 1:2 ... tests/chaos/chaos_job.py --dataset-size 384 ...

It takes the example's own arguments and trains exactly as the example does; the hooks change
timing only, never the math, so a run with hooks gives the same weights as one without. They are
injected through the runtime's fault hook (``elastic_trainer.train.loop.FaultHook``), called after
each step's last forward (``before_control``) with the step's number.

Hooks (environment variables of one node, so one node can misbehave while the others do not):

``CHAOS_SLOW_MS`` and ``CHAOS_SLOW_STEPS``
    A straggler: each rank of this node sleeps ``CHAOS_SLOW_MS`` milliseconds after the forward
    of each of its first ``CHAOS_SLOW_STEPS`` steps (before the backward, so that the time counts
    as the rank's compute, as a slow GPU's would), then runs at full speed.
``CHAOS_SLOW_WHILE_FILE`` (with ``CHAOS_SLOW_MS``)
    Each rank of this node sleeps ``CHAOS_SLOW_MS`` milliseconds in each step while this file
    exists: the job keeps stepping (no watchdog sees a frozen worker) but cannot end before the
    scenario removes the file, however slowly a process it waits for starts on a loaded machine.
``CHAOS_EXIT_BEFORE_STEP``
    Each rank of this node exits (code 0) while computing that step, after the previous step and
    its checkpoint are complete. With ``--checkpoint-every 1`` a run thus ends at an exact step: the
    suite replays a faulty run's world-size changes at the same steps without faults (see
    :mod:`tests.chaos.invariants`). (SIGTERM cannot do this: the runtime may take one more step
    before it stops.)
``CHAOS_BLOCK_AT_STEP`` and ``CHAOS_BLOCK_FILE``
    At that step, if this file exists, the rank deletes it and blocks for good using no CPU, as a
    survivor blocked in a collective that no abort reaches does (DDP's bucket rebuild in a new
    model's second forward): only the heal's stop watch ends it. Its replacement finds no file.
``CHAOS_DTYPE=float64``
    Not a fault: every rank computes in float64 (the default dtype, set before the example builds
    its data and model). Two runs that took different world sizes sum in different orders; in
    float32 that 1e-7 grows, over a hundred steps at a high learning rate, to 0.5 % of what
    training moved a weight (issue 41), so a comparison with an uninterrupted run can only be
    loose; in float64 it stays near 1e-12, and any real difference (a step lost, repeated or
    resumed from the wrong state) stands out by orders of magnitude.
``CHAOS_BLOCK_WHERE=backward``
    Blocks inside the next step's backward instead (a global module backward hook, armed at that
    step's control: the step's own graph was built without it), where DDP waits on a gradient
    bucket that gloo left blocked after an abort (issue 30: no hook tracks the buckets).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

from elastic_trainer.examples import synthetic_cnn as example

SLOW_MS_ENV = "CHAOS_SLOW_MS"
SLOW_STEPS_ENV = "CHAOS_SLOW_STEPS"
EXIT_BEFORE_STEP_ENV = "CHAOS_EXIT_BEFORE_STEP"
SLOW_WHILE_FILE_ENV = "CHAOS_SLOW_WHILE_FILE"
BLOCK_AT_STEP_ENV = "CHAOS_BLOCK_AT_STEP"
BLOCK_FILE_ENV = "CHAOS_BLOCK_FILE"
BLOCK_WHERE_ENV = "CHAOS_BLOCK_WHERE"
DTYPE_ENV = "CHAOS_DTYPE"

_block_in_backward = threading.Event()  # armed before a backward: its first module hook blocks


def _blocking_backward_hook(module: object, grad_input: object, grad_output: object) -> None:
    if _block_in_backward.is_set():
        print("chaos: blocking inside the backward", flush=True)
        threading.Event().wait()  # no CPU, no end, inside the autograd engine


def chaos_hook(
    slow_s: float,
    slow_steps: int,
    exit_before: int | None,  # type: ignore[no-untyped-def]
    slow_while: str | None = None,
    block: tuple[int, str] | None = None,
):
    """The fault hook of the module docstring."""

    def hook(point: str, step: int) -> None:
        if point != "before_control":
            return
        if block is not None and step == block[0] and os.path.exists(block[1]):
            os.unlink(block[1])
            print(f"chaos: blocking at step {step}", flush=True)
            if os.environ.get(BLOCK_WHERE_ENV) == "backward":
                torch.nn.modules.module.register_module_full_backward_hook(_blocking_backward_hook)
                _block_in_backward.set()
                return
            threading.Event().wait()  # no CPU, no end
        slowed = os.path.exists(slow_while) if slow_while is not None else step <= slow_steps
        if slowed:
            time.sleep(slow_s)
        if exit_before is not None and step >= exit_before:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    return hook


def main() -> int:
    if os.environ.get(DTYPE_ENV) == "float64":
        torch.set_default_dtype(torch.float64)
    slow_ms = float(os.environ.get(SLOW_MS_ENV, "0") or 0)
    exit_before = os.environ.get(EXIT_BEFORE_STEP_ENV)
    block_at, block_file = os.environ.get(BLOCK_AT_STEP_ENV), os.environ.get(BLOCK_FILE_ENV)
    hook = chaos_hook(
        slow_ms / 1000,
        int(os.environ.get(SLOW_STEPS_ENV, "1000000000")) if slow_ms > 0 else 0,
        int(exit_before) if exit_before else None,
        os.environ.get(SLOW_WHILE_FILE_ENV) or None,
        (int(block_at), block_file) if block_at and block_file else None,
    )
    return example.main(fault_hook=hook)


if __name__ == "__main__":
    example._exit(main())
