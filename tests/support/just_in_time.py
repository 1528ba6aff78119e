"""A :class:`~elastic_trainer.checkpoint.jit.JustInTime` over a fake training state, for the tests
of its triggers, bounds and claims: the step, the snapshot and the write are the test's callables,
and the manager's background writer is a ``drain`` callable."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from elastic_trainer.checkpoint.jit import JustInTime
from elastic_trainer.state.guard import StateGuard
from tests.support.dist_env import cpu_env


class FakeState:
    """What the saver reads of a ``TrainingState``: its guard, its step and a snapshot."""

    def __init__(
        self, guard: StateGuard, step: Callable[[], int], snapshot: Callable[[], dict[str, Any]]
    ) -> None:
        self.guard, self._step, self._snapshot = guard, step, snapshot
        self.objects: dict[str, Any] = {}
        self.copies = self.sharded = None
        self.seed, self.epoch = 0, 0

    @property
    def step(self) -> int:
        return self._step()

    def snapshot(self) -> dict[str, Any]:
        return self._snapshot()

    def arm(self) -> None:
        pass

    def track_buffers(self, enabled: bool) -> None:
        pass


class FakeWriter:
    """The manager's background writer: ``wait(timeout)`` is the test's ``drain``."""

    def __init__(self, drain: Callable[[float], Any]) -> None:
        self._drain = drain

    def wait(self, timeout: float | None = None) -> None:
        self._drain(0.0 if timeout is None else timeout)


def just_in_time(
    *,
    guard: StateGuard,
    directory: str | None,
    step: Callable[[], int],
    payload: Callable[[], dict[str, Any]],
    write: Callable[[int, dict[str, Any]], str],
    rank: int = 0,
    drain: Callable[[float], Any] = lambda timeout: None,
    exit_fn: Callable[[int], Any] = lambda code: None,
    writing: Callable[[], int | None] = lambda: None,
    own_shards: bool = False,
) -> JustInTime:
    """A saver set up on this thread (the training thread). ``payload()`` is the snapshot (an
    ``epoch`` of 0 is added), ``write(step, payload)`` writes it. ``own_shards``: as sharded state
    without the neighbour copy: no claim (every rank writes its own part, ``write`` here) and no
    save from another thread."""
    sharded = None
    if own_shards:
        sharded = SimpleNamespace(
            token=0,
            save_own=lambda data, *, step, epoch: SimpleNamespace(path=write(step, data)),
        )
    saver = JustInTime(
        state=FakeState(guard, step, payload),  # type: ignore[arg-type]
        env=cpu_env(rank, max(rank + 1, 1)),
        directory=directory,
        switch=True,
        sharded=sharded,  # type: ignore[arg-type]
        writer=FakeWriter(drain),  # type: ignore[arg-type]
        payload=lambda snapshot: {"epoch": 0, **snapshot},
        write_file=lambda data, step, epoch: write(step, data),
        writing=writing,
        exit_fn=exit_fn,
    )
    saver.setup(True)
    return saver
