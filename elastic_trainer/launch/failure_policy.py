"""The launcher's restart decision: heal what a restart can heal, stop at once on what it cannot.

Each time torchrun's agent finds its worker group failed, :class:`FailurePolicy` reads what the
workers recorded (:mod:`elastic_trainer.runtime.failures`): a **deterministic** failure stops the
job without spending a restart, an **error** in the user's code gets one restart, anything else is
**transient** and restarts as plain torchrun would. The root cause is the earliest failure that is
not a consequence of another. Pure: the agent hook is
:func:`elastic_trainer.runtime.torch_compat.on_group_failure`, the printing in the launcher.
Design: ``docs/design/launcher.md``.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_trainer.runtime.exit_codes import EXIT_STOPPED
from elastic_trainer.runtime.failures import FailureClass, FailureReport, read_report


@dataclass(frozen=True, slots=True)
class RankFailure:
    """One failed worker, as the agent saw it."""

    rank: int
    exitcode: int
    report: FailureReport | None
    """What the worker recorded, if it recorded anything."""
    timestamp: float

    @classmethod
    def from_process_failure(cls, rank: int, failure: Any) -> RankFailure:
        """From torch's ``ProcessFailure`` (``exitcode``, ``error_file_data``, ``timestamp``)."""
        report = read_report(getattr(failure, "error_file_data", None))
        return cls(
            rank=rank,
            exitcode=int(failure.exitcode),
            report=report,
            timestamp=report.time
            if report is not None
            else float(getattr(failure, "timestamp", 0)),
        )

    @property
    def is_consequence(self) -> bool:
        """It recorded a transient failure: it failed because another rank did."""
        return self.report is not None and self.report.failure_class is FailureClass.TRANSIENT

    @property
    def failure_class(self) -> FailureClass:
        if self.report is not None:
            return self.report.failure_class
        if self.exitcode == 2:
            return FailureClass.DETERMINISTIC
        return FailureClass.TRANSIENT  # a signal, or an exit with no explanation: give it a restart

    @property
    def summary(self) -> str:
        if self.report is not None:
            return self.report.summary
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"killed by {name}"
        if self.exitcode == 2:
            return "exited with status 2 (a usage error)"
        if self.exitcode == EXIT_STOPPED:
            return "stopped gracefully (this node or a peer was asked to stop: a scale-down or a new member)"
        return f"exited with status {self.exitcode}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do about one failure of the worker group."""

    restart: bool
    root_cause: RankFailure
    reason: str
    """One line: why the job stops or restarts."""

    @property
    def traceback(self) -> str | None:
        """The root cause's traceback when it is an error in the user's code (printed once)."""
        report = self.root_cause.report
        if report is None or report.failure_class is not FailureClass.ERROR:
            return None
        return report.traceback or None

    @property
    def exit_code(self) -> int:
        """The launcher's exit status when the job stops on this verdict."""
        return 2 if self.root_cause.failure_class is FailureClass.DETERMINISTIC else 1


@dataclass
class FailurePolicy:
    """Decides each failure of one agent's worker group; remembers errors across restarts."""

    _seen_errors: set[str] = field(default_factory=set)

    def judge(self, failures: Mapping[int, Any]) -> Verdict:
        """Decide on the failures torch's agent reported (``{global rank: ProcessFailure}``)."""
        # A rank that recorded a transient failure (a collective failed) is a consequence of another
        # rank's failure: a rank killed by a signal records nothing and is the likelier cause, whatever
        # the clock says (a failure without a record is time-stamped, in whole seconds, when the agent
        # noticed it). So is a rank killed by SIGTERM beside one that failed otherwise: SIGTERM is
        # what the agent sends the rest of the group once it saw a failure, and it can reach a rank
        # before that rank recorded its own consequence (CI, on a loaded machine: "rank 0 failed:
        # killed by SIGTERM" where rank 1 had been SIGKILLed).
        ranks = sorted(
            (RankFailure.from_process_failure(rank, failure) for rank, failure in failures.items()),
            key=lambda f: (f.is_consequence, f.exitcode == -signal.SIGTERM, f.timestamp, f.rank),
        )
        if not ranks:
            raise ValueError("a failed worker group with no failed worker")
        deterministic = [f for f in ranks if f.failure_class is FailureClass.DETERMINISTIC]
        if deterministic:
            cause = deterministic[0]
            return Verdict(
                False,
                cause,
                f"rank {cause.rank} failed: {cause.summary}; a restart cannot fix this",
            )
        errors = [
            f for f in ranks if f.failure_class is FailureClass.ERROR and f.report is not None
        ]
        repeated = [
            f for f in errors if f.report is not None and f.report.signature in self._seen_errors
        ]
        if repeated:
            cause = repeated[0]
            return Verdict(
                False,
                cause,
                f"rank {cause.rank} failed: {cause.summary}, again after a restart; "
                "stopping instead of retrying",
            )
        self._seen_errors.update(f.report.signature for f in errors if f.report is not None)
        cause = errors[0] if errors else ranks[0]
        return Verdict(True, cause, f"rank {cause.rank} failed: {cause.summary}")
