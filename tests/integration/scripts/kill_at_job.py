"""The example job with a fault injected at an exact point of a step (a test's worker script).

    python tests/integration/scripts/kill_at_job.py RANK:STEP:POINT [example arguments...]

SIGKILLs the worker of global rank RANK at POINT of step STEP in the first generation of workers
(``TORCHELASTIC_RESTART_COUNT`` 0): ``before_control`` (the step's last forward done, its control
allreduce not started) or ``after_update`` (the step's update applied, before the next collective).
Injected through the runtime's fault hook, not an environment switch of the runtime.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from elastic_trainer.examples import synthetic_cnn as example

POINTS = ("before_control", "after_update")


def kill_at(rank: int, step: int, point: str):  # type: ignore[no-untyped-def]
    if point not in POINTS:
        raise SystemExit(f"POINT must be one of {', '.join(POINTS)}, got {point!r}")
    this_rank = int(os.environ.get("RANK", "0"))
    first_generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def hook(where: str, current: int) -> None:
        if first_generation and (this_rank, where, current) == (rank, point, step):
            logging.getLogger("kill_at_job").warning(
                "test hook: SIGKILLing this worker at %s of step %d", point, step
            )
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


if __name__ == "__main__":
    rank, step, point = sys.argv[1].split(":")
    example._exit(example.main(sys.argv[2:], fault_hook=kill_at(int(rank), int(step), point)))
