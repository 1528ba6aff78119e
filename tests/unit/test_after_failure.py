"""Code after ``with step:`` that runs for a failed attempt is named (issue 40 item 3): the trace
sees the loop frame's lines between a failed ``__exit__`` and the next step, and stays quiet for
the ``with`` and the ``for`` themselves, for a body that checks ``step.completed``, and when a
debugger or coverage tool already traces."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from elastic_trainer.train.after_failure import AfterFailureTrace, after_failure_message


class _Step:
    """The part of ``Step`` the trace needs: a ``with`` that takes a failure, ``completed``."""

    def __init__(self) -> None:
        self.trace: AfterFailureTrace | None = None
        self.ran: tuple[str, int] | None = None

    @property
    def completed(self) -> bool:
        if self.trace is not None:
            self.trace.guarded = True
        return False

    def __enter__(self) -> _Step:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.trace = AfterFailureTrace(sys._getframe(1))
        return True


def _steps(seen: list[tuple[str, int] | None]) -> Iterator[_Step]:
    for _ in range(2):
        step = _Step()
        yield step
        assert step.trace is not None
        seen.append(step.trace.stop())


def _unguarded(seen: list[tuple[str, int] | None]) -> list[int]:
    logged = []
    for step in _steps(seen):
        with step:
            raise RuntimeError("a peer died")
        logged.append(1)  # the line that must be named
    return logged


def _guarded(seen: list[tuple[str, int] | None]) -> list[int]:
    logged = []
    for step in _steps(seen):
        with step:
            raise RuntimeError("a peer died")
        if step.completed:
            logged.append(1)
    return logged


def _nothing_after(seen: list[tuple[str, int] | None]) -> None:
    for step in _steps(seen):
        with step:
            raise RuntimeError("a peer died")


def test_the_first_line_after_a_failed_with_is_named() -> None:
    seen: list[tuple[str, int] | None] = []
    assert _unguarded(seen) == [1, 1]
    line = _unguarded.__code__.co_firstlineno + 5
    assert seen == [(__file__, line)] * 2, seen
    assert sys.gettrace() is None, "the trace is gone after the window"
    message = after_failure_message(7, seen[0])
    assert message.startswith("step 7 failed and is redone, yet the code after `with step:` ran")
    assert f"{__file__}:{line}" in message and "if step.completed:" in message


def test_a_body_that_checks_completed_or_has_nothing_after_is_quiet() -> None:
    seen: list[tuple[str, int] | None] = []
    assert _guarded(seen) == []
    _nothing_after(seen)
    assert seen == [None] * 4, seen


def test_a_tracer_already_there_is_left_alone() -> None:
    def tracer(frame: Any, event: str, arg: Any) -> None:
        return None

    seen: list[tuple[str, int] | None] = []
    sys.settrace(tracer)
    try:
        _unguarded(seen)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    assert seen == [None, None]
