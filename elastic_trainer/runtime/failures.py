"""Worker failures: is it worth a restart? Classify, record for the launcher, report once.

A failure is ``deterministic`` (a restart cannot help: the script does not import, a bad
configuration, an unusable checkpoint directory, exit status 2), ``transient`` (a peer died, a
collective failed, the node is stopping) or an ``error`` of the user's code (one restart). The
class travels in torchrun's own error file (``TORCHELASTIC_ERROR_FILE``), in torch's format plus an
``elastic_trainer`` section, for :mod:`elastic_trainer.launch.failure_policy`. Import-light: it is
loaded only after a failure and never imports torch. Design: ``docs/design/launcher.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import os
import re
import sys
import time
import traceback
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

# The error classes live in errors.py (settings raises them too); re-exported here.
from elastic_trainer.runtime.errors import ConfigError as ConfigError
from elastic_trainer.runtime.errors import DeterministicError as DeterministicError
from elastic_trainer.runtime.errors import UserError as UserError
from elastic_trainer.runtime.exit_codes import EXIT_DETERMINISTIC as EXIT_DETERMINISTIC
from elastic_trainer.runtime.exit_codes import EXIT_FAILED as EXIT_FAILED
from elastic_trainer.runtime.settings import ENV_ERROR_FILE, ENV_REPORTS_FAILURES

_STEP_ATTR = "_elastic_trainer_step"


class FailureClass(str, enum.Enum):
    """Whether a restart can heal a failure (see the module docstring)."""

    DETERMINISTIC = "deterministic"
    TRANSIENT = "transient"
    ERROR = "error"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit status 2 (every command of the project), and
    which refuses abbreviated options (``--nproc-per-nod`` is a typo, not ``--nproc-per-node``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True, slots=True)
class FailureReport:
    """What one worker recorded about its failure."""

    failure_class: FailureClass
    summary: str
    """One line: what went wrong, for people."""
    signature: str
    """Equal for the same error at the same place and step (the launcher's repeat check)."""
    step: int | None
    rank: int | None
    time: float
    traceback: str

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["failure_class"] = self.failure_class.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FailureReport:
        return cls(
            failure_class=FailureClass(data["failure_class"]),
            summary=str(data["summary"]),
            signature=str(data["signature"]),
            step=None if data.get("step") is None else int(data["step"]),
            rank=None if data.get("rank") is None else int(data["rank"]),
            time=float(data["time"]),
            traceback=str(data.get("traceback", "")),
        )


ABORT_MARKER = "heal: the process group was aborted"
"""Begins the error of a collective wait that a heal round ended (``runtime/abortable.py``)."""
_LOST_LINK_MARKERS = (
    ABORT_MARKER,
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "gloo/transport",
    "NCCL communicator was aborted",
)
_COLLECTIVE_FAILURE_MARKERS = (
    *_LOST_LINK_MARKERS,
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "NCCL error",
    "Socket Timeout",
)
# Evidence of a lost or silent peer, whatever else the message says.
_PEER_LOST_MARKERS = (*_LOST_LINK_MARKERS, "imed out", "imeout")
_ARGUMENT_CHECK = re.compile(
    # A backend refusing the call's own arguments: a bug of the caller's, the same on a restart.
    # torch 2.13's gloo says "ProcessGroupGloo::allgather: invalid tensor size ..." or "Check
    # failed: outputShape[0] * worldSize == inputShape[0]"; NCCL "invalid usage"/"invalid argument".
    r"ProcessGroup(?:Gloo|NCCL)::\w+: |Check failed: |invalid usage|invalid argument",
    re.IGNORECASE,
)


def _argument_check(text: str) -> bool:
    return bool(_ARGUMENT_CHECK.search(text)) and not any(m in text for m in _PEER_LOST_MARKERS)


class GroupAborted(RuntimeError):
    """Raised by the training thread at a step boundary when a heal round is open (a group of one
    rank has no connection whose end would tell it)."""


def is_collective_failure(exc: BaseException) -> bool:
    """Did a peer die? Whether ``exc`` is a collective that failed because a peer went away or
    timed out, or that a heal round aborted. The one answer: the launcher's failure class, the
    training loop and the healer all ask here.

    torch 2.13's gloo raises a plain ``RuntimeError`` ("... Connection closed by peer ...") from
    collectives and from DDP's backward, not a ``DistError``; both are recognised. A backend's
    refusal of the call's arguments (a wrong tensor size, an invalid root rank) is not: it names
    the process group too, but a restart meets it again.
    """
    if isinstance(exc, GroupAborted):
        return True
    text = str(exc)
    if _argument_check(text):
        return False
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in _COLLECTIVE_FAILURE_MARKERS
    )


def note_step(exc: BaseException, step: int) -> None:
    """Record on ``exc`` the step it was raised in (the training loop calls this)."""
    if getattr(exc, _STEP_ATTR, None) is None:
        with contextlib.suppress(
            AttributeError
        ):  # a type with __slots__: no step, still classified
            setattr(exc, _STEP_ATTR, step)


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def message_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, without a C++ ``[file.cc:NN]`` prefix."""
    text = str(exc).strip()
    return _SOURCE_PREFIX.sub("", text.splitlines()[0]) if text else ""


def log_line(exc: BaseException) -> str:
    """``"<first line of the message> (<type>)"``: for log lines that must not look like a
    traceback (operators and the chaos suite grep worker logs for ``Error:``)."""
    line = message_line(exc)
    return f"{line} ({type(exc).__name__})" if line else type(exc).__name__


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (the message alone for the runtime's own errors)."""
    line = message_line(exc)
    if isinstance(exc, DeterministicError) and line:
        return line
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def classify(exc: BaseException) -> tuple[FailureClass, str]:
    """The class of ``exc`` and a one-line summary of it."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code == EXIT_DETERMINISTIC:
            return FailureClass.DETERMINISTIC, "the worker exited with status 2 (a usage error)"
        return FailureClass.ERROR, f"the worker exited with status {code}"
    if isinstance(exc, KeyboardInterrupt):
        return FailureClass.TRANSIENT, "interrupted"
    if is_collective_failure(exc):
        cause = message_line(exc).split(". ")[0]  # gloo appends advice to its first sentence
        return FailureClass.TRANSIENT, f"a collective failed (a peer died or timed out): {cause}"
    if isinstance(exc, SyntaxError):
        where = f" ({exc.filename}, line {exc.lineno})" if exc.filename else ""
        return FailureClass.DETERMINISTIC, f"SyntaxError: {exc.msg}{where}"
    if isinstance(exc, (ImportError, DeterministicError)):
        return FailureClass.DETERMINISTIC, first_line(exc)
    mistake = setup_mistake(exc)
    if mistake is not None:
        return FailureClass.DETERMINISTIC, mistake
    return FailureClass.ERROR, first_line(exc)


_NO_GROUP = "Default process group has not been initialized"
_BAD_CALL = re.compile(
    r"^(?P<name>\w+)\.__init__\(\) (?:missing \d+ required|got an unexpected keyword argument"
    r"|got multiple values for argument|takes \d+ positional)"
)


def setup_mistake(exc: BaseException) -> str | None:
    """One line for a setup mistake of the user's script that no restart can fix, else ``None``:

    * torch.distributed used before the runtime formed the process group (``DistributedSampler``
      is the usual one: the runtime's ``ElasticSampler`` hands out the data instead);
    * a public class of this package called with a wrong argument (``Elastic(...)`` without
      ``global_batch_size``).
    """
    line = message_line(exc)
    if isinstance(exc, (ValueError, RuntimeError)) and _NO_GROUP in line:
        return (
            "torch.distributed was used before elastic-trainer formed the process group (a "
            "DistributedSampler?): the runtime's ElasticSampler hands out each rank's samples, so drop "
            "the DistributedSampler; use torch.distributed only inside the elastic loop"
        )
    match = _BAD_CALL.match(line) if isinstance(exc, TypeError) else None
    if match is not None:
        import elastic_trainer  # the package root is lazy: this loads nothing else

        if match["name"] in elastic_trainer.__all__:
            return f"{line.replace('.__init__()', '(...)', 1)} (see docs/own-loop.md)"
    return None


def _signature(exc: BaseException, step: int | None) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    return f"{type(exc).__module__}.{type(exc).__qualname__}@{where}#step={step}"


def report_of(exc: BaseException, *, rank: int | None = None) -> FailureReport:
    """Classify ``exc`` into a :class:`FailureReport` (with its traceback)."""
    failure_class, summary = classify(exc)
    step = getattr(exc, _STEP_ATTR, None)
    if step is not None:
        summary = f"{summary} (in step {step})"
    return FailureReport(
        failure_class=failure_class,
        summary=summary,
        signature=_signature(exc, step),
        step=step,
        rank=rank,
        time=time.time(),
        traceback=summary + "\n"
        if failure_class is FailureClass.DETERMINISTIC
        else users_traceback(exc),
    )


_LIBRARY = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def users_traceback(exc: BaseException) -> str:
    """``exc``'s traceback without the library's frames outside the user's first one (the run's
    iteration that re-raises a step's failure is no part of the user's error); those the user's
    code called stay, and all of them when no frame is the user's (an error of the library)."""
    shown = traceback.TracebackException.from_exception(exc)
    stack = list(shown.stack)
    outer = next((i for i, f in enumerate(stack) if not f.filename.startswith(_LIBRARY)), 0)
    shown.stack = traceback.StackSummary.from_list(stack[outer:])
    return "".join(shown.format())


def _first_on_this_node(report: FailureReport, error_file: str | None) -> bool:
    """Whether this rank is the first of its node's attempt to say ``report``'s error: torchrun
    gives each attempt one folder of per-rank error files, where the first to claim the error's
    signature says it (the others of the same error stay quiet). True where there is no such
    folder."""
    if not error_file:
        return True
    attempt = os.path.dirname(os.path.dirname(error_file))
    digest = zlib.crc32(report.signature.encode())
    try:
        os.close(os.open(os.path.join(attempt, f"said-{digest:08x}"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


_recorded = False


def record(report: FailureReport, *, error_file: str | None) -> bool:
    """Write ``report`` to torchrun's error file, once per process; False when there is none.

    The file is torch's format (``ErrorHandler.record_exception``), so torchrun's own root-cause
    report shows it, with ``errorTraits`` and an ``elastic_trainer`` section added.
    """
    global _recorded
    path = error_file
    if not path:
        return False
    if _recorded:
        return True
    data = {
        "message": {
            "message": report.summary,
            "extraInfo": {"py_callstack": report.traceback, "timestamp": str(int(report.time))},
        },
        "errorTraits": {
            "category": report.failure_class.value,
            "retryability": str(report.failure_class is not FailureClass.DETERMINISTIC),
        },
        "elastic_trainer": report.to_json(),
    }
    try:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(data, file)
    except OSError:
        return False
    _recorded = True
    return True


def read_report(error_file_data: Any) -> FailureReport | None:
    """The report inside an error file's JSON, or ``None`` (not ours, or malformed)."""
    if not isinstance(error_file_data, dict) or not isinstance(
        error_file_data.get("elastic_trainer"), dict
    ):
        return None
    try:
        return FailureReport.from_json(error_file_data["elastic_trainer"])
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class ReportTarget:
    """Where a worker's failure goes: its rank, torchrun's error file, whether the launcher prints
    root causes. :meth:`from_environ` is for entry points: it never fails (a failure to report
    must not hide the failure)."""

    rank: int | None = None
    error_file: str | None = None
    launcher_reports: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ReportTarget:
        env = os.environ if environ is None else environ
        raw = env.get("RANK", "")
        return cls(
            rank=int(raw) if raw.isdigit() else None,
            error_file=env.get(ENV_ERROR_FILE) or None,
            launcher_reports=env.get(ENV_REPORTS_FAILURES, "").strip() == "1",
        )


def exit_after(exc: BaseException, *, prog: str, target: ReportTarget | None = None) -> int:
    """Record ``exc``, tell the user what happened, return the worker's exit status.

    Under ``elastic-trainer run`` nothing for a mistake or an error in the code (the launcher
    prints the root cause and, for an error in the code, its traceback once). Elsewhere the first
    rank of the node's attempt with the error says it: the user's traceback for an error in the
    code, one line for a mistake. A transient failure: one line a rank. ``target`` defaults to :meth:`ReportTarget.from_environ` (entry points).
    """
    target = ReportTarget.from_environ() if target is None else target
    report = report_of(exc, rank=target.rank)
    record(report, error_file=target.error_file)
    where = f" (rank {report.rank})" if report.rank is not None else ""
    if report.failure_class is FailureClass.TRANSIENT:
        sys.stderr.write(f"{prog}: {report.summary}{where}; stopping for a restart\n")
    elif target.launcher_reports or not _first_on_this_node(report, target.error_file):
        pass  # said once: by the launcher (the root cause), or by another rank of this attempt
    elif report.failure_class is FailureClass.ERROR:
        sys.stderr.write(report.traceback)
    else:
        sys.stderr.write(f"{prog}: error: {report.summary}{where}\n")
    sys.stderr.flush()
    return EXIT_DETERMINISTIC if report.failure_class is FailureClass.DETERMINISTIC else EXIT_FAILED
