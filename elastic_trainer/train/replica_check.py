"""The routine comparison of the data-parallel replicas' parameters, on the step's control.

Invariant: every rank takes its checksum after the same steps and reads the same reduced bits, so
every rank raises :class:`ReplicasDivergedError` at the same step or none does. Design, cost and
blind spots: ``docs/design/own-loop.md``.
"""

from __future__ import annotations

from elastic_trainer.runtime import failures
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.step_control import ControlResult
from elastic_trainer.state.training_state import TrainingState, state_checksum


class ReplicasDivergedError(failures.DeterministicError):
    """The data-parallel replicas' parameters differ: state kept outside the run."""


class ReplicaCheck:
    """Compares the replicas' parameters on the step's control: a checksum of this rank's
    parameters after step ``S`` rides on step ``S+1``'s control, and the reduced bits say whether
    every replica sent the same one. Due after the first two steps of every start (a fresh start,
    a resume, a heal) and every ``every`` steps; never for one rank, a sharded model (its ranks'
    shards differ by design) or ``every=0``. Design: ``docs/design/own-loop.md``."""

    def __init__(self, state: TrainingState, env: DistEnv, *, every: int) -> None:
        self._state, self._every = state, every
        self._enabled = every > 0 and env.world_size > 1 and state.sharded is None
        self._first = 0
        self._equal_at: int | None = None
        self._ready: tuple[int, int] | None = None

    def started(self, step: int) -> None:
        """This attempt's state is in place at ``step`` (loaded, taken from a peer, or fresh)."""
        self._first = step

    def after_update(self, step: int) -> None:
        """(every rank, after step ``step``'s update) take the checksum when it is due."""
        if not self._enabled or self._state.model is None:
            return
        if step - self._first <= 2 or step % self._every == 0:
            params = list(self._state.model.parameters())
            self._ready = (step, state_checksum(params))

    def take(self) -> tuple[int, int] | None:
        """The checksum for the control being started, once."""
        ready, self._ready = self._ready, None
        return ready

    def compared(self, result: ControlResult) -> None:
        """Read a finished control's comparison; raises when the replicas differ."""
        if result.replicas_differ is None or result.checksum_of is None:
            return
        step = result.checksum_of
        if not result.replicas_differ:
            self._equal_at = step
            return
        since = (
            f"equal after step {self._equal_at}"
            if self._equal_at is not None
            else "not compared before in this attempt"
        )
        raise ReplicasDivergedError(
            f"the replicas' parameters differ after step {step} ({since}): state kept outside the run makes the "
            "ranks update differently; likely an own step counter driving the learning rate (use step.number), "
            "a per-rank random generator, or an optimizer/scheduler built after Elastic(...) or not in states="
        )
