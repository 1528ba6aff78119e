"""What the training loop reports, and to whom: the seam between the runtime and its metrics.

The runtime calls a :class:`TrainingObserver`; :mod:`elastic_trainer.metrics.worker` implements it for
Prometheus, :class:`NullObserver` does nothing (metrics off, and unit tests).
"""

from __future__ import annotations

from typing import Any, Protocol


class TrainingObserver(Protocol):
    """Receives the runtime's events. Every method must be cheap and must not synchronise.
    Each does nothing here, so that an observer may subclass this and implement only some."""

    def on_start(
        self, *, world_size: int, restart_count: int, total_steps: int | None = None
    ) -> None:
        """Workers (re)started in a world of ``world_size`` ranks, after ``restart_count`` restarts.
        Called again after each heal in place, on the new process group: this process's rank is
        that group's (``torch.distributed.get_rank()``), which may differ from ``RANK``.

        ``total_steps``: the optimizer steps the job trains for in all (``max_steps``, or
        epochs x steps per epoch), when known: the target of the progress and ETA."""
        return None

    def on_step(
        self,
        *,
        step: int,
        duration_s: float,
        data_wait_s: float,
        samples: int,
        tokens: int,
        loss: float | None,
        lr: float | None = None,
    ) -> None:
        """One optimizer step finished on this rank (``samples``/``tokens`` this rank processed).

        Values arrive as Python numbers (never tensors: reading one would synchronise with the
        GPU); ``lr`` is the learning rate the step used (first parameter group), when known."""
        return None

    def on_priming(self, *, backward_passes: int) -> None:
        """``backward_passes`` synchronised backward passes ran that belong to no step (DDP bucket
        priming after a restart): their allreduces are real, but no step will report them.
        Optional: the runtime skips the call for an observer without this method."""
        return None

    def on_checkpoint_saved(self, *, step: int, duration_s: float, nbytes: int) -> None:
        """Rank 0 wrote a checkpoint of ``step`` (``duration_s`` of training stall)."""
        return None

    def on_checkpoint_loaded(self, *, step: int, duration_s: float, nbytes: int) -> None:
        """This rank restored a checkpoint of ``step``."""
        return None

    def wrap_ddp(self, ddp_model: Any) -> None:
        """Install communication hooks (allreduce timing) on a freshly built DDP model."""
        return None


class NullObserver(TrainingObserver):
    """A :class:`TrainingObserver` that records nothing (the protocol's methods do nothing)."""
