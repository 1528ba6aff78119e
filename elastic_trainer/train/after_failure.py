"""Code after ``with step:`` that runs for a failed attempt of the step.

``with step:`` takes a step's failure for healing and the loop goes on to redo the step, so Python
runs the rest of the loop body first: a log line or a counter there runs once more than there are
steps. Python has no way for a ``with`` to skip the code after it, so the recipe puts that code
under ``if step.completed:`` and :class:`AfterFailureTrace` names the mistake: from the failed
``__exit__`` to the next step it traces the lines of the loop's frame alone (``frame.f_trace``,
with a global trace function that traces no call), and reports the first line that ran other than
the ``with`` and the ``for`` themselves, unless the body read :attr:`Step.completed` there.
A debugger or coverage tool that traces already wins: nothing is traced then. Design:
``docs/design/own-loop.md``.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

__all__ = ["AfterFailureTrace", "after_failure_message"]


def _calls_untraced(frame: FrameType, event: str, arg: Any) -> None:
    """The global trace function of the window: no frame but the loop's is traced."""
    return None


class AfterFailureTrace:
    """The lines the loop's frame runs between a failed ``with step:`` and the next step."""

    def __init__(self, frame: FrameType) -> None:
        self._frame: FrameType | None = frame
        self._with_line = frame.f_lineno
        self._lines: list[int] = []
        self.guarded = False
        """The body read :attr:`Step.completed` in the window (it knows the step failed)."""
        if sys.gettrace() is not None:
            self._frame = None  # a debugger's or a coverage tool's: leave tracing to it
            return
        frame.f_trace = self._line
        frame.f_trace_lines = True
        sys.settrace(_calls_untraced)

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self._lines.append(frame.f_lineno)
        return self._line

    def stop(self) -> tuple[str, int] | None:
        """End the window (idempotent): ``(file, line)`` of the first line after ``with step:``
        that ran for the failed attempt, or ``None``."""
        frame, self._frame = self._frame, None
        if frame is None:
            return None
        sys.settrace(None)
        frame.f_trace = None
        skip = {self._with_line, frame.f_lineno}  # the with's exit, and the for taking the next
        ran = [line for line in self._lines if line not in skip]
        if not ran or self.guarded:
            return None
        return frame.f_code.co_filename, ran[0]


def after_failure_message(number: int, where: tuple[str, int]) -> str:
    """The warning (one line) for code after ``with step:`` that ran for a failed attempt."""
    path, line = where
    return (
        f"step {number} failed and is redone, yet the code after `with step:` ran for the failed "
        f"attempt ({path}:{line}): put it under `if step.completed:` so that it runs once per "
        "step (docs/own-loop.md)"
    )
