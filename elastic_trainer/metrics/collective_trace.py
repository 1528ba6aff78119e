"""Per-collective timings read from torch's flight recorder (no Python per bucket).

:class:`CollectiveTrace` reads the recorder's ring and returns one group's finished, timed
collectives of one kind, each once, in launch order, without waiting for any. Only NCCL times its
entries (``TORCH_NCCL_ENABLE_TIMING=1``). Which collectives are DDP's buckets, and of which step,
is :mod:`elastic_trainer.metrics.bucket_trace`'s business. Design and read costs:
``docs/design/metrics.md``.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from elastic_trainer.runtime import torch_compat
from elastic_trainer.runtime.settings import ENV_FR_BUFFER_SIZE

NCCL_ENABLE_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"
DEFAULT_BUFFER_ENTRIES = 2000
"""torch's own default ring size: the recorder is on unless ``TORCH_FR_BUFFER_SIZE=0``."""

# Bytes per element of the dtype names the flight recorder writes (c10's ScalarType names).
_DTYPE_BYTES = {
    "Bool": 1, "Byte": 1, "Char": 1, "Short": 2, "Int": 4, "Long": 8,
    "Half": 2, "BFloat16": 2, "Float": 4, "Double": 8,
    "ComplexHalf": 4, "ComplexFloat": 8, "ComplexDouble": 16,
    "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1,
    "UInt16": 2, "UInt32": 4, "UInt64": 8,
}  # fmt: skip

Dump = Callable[[], bytes]
"""Returns the flight recorder's pickled dump (collectives only, no stack traces)."""


class TraceFormatError(ValueError):
    """The flight recorder's dump is not in the format this reader knows."""


def trace_environment(
    environ: MutableMapping[str, str], *, entries: int = DEFAULT_BUFFER_ENTRIES
) -> dict[str, str]:
    """Turn the flight recorder (``entries`` deep) and NCCL's collective timing on in ``environ``.

    Must run before the process creates its first process group: the recorder reads its size once.
    Values the user set are kept (a buffer of 0 keeps the recorder off). Returns what was set.
    """
    if entries < 1:
        raise ValueError(f"entries must be >= 1, got {entries}")
    wanted = {ENV_FR_BUFFER_SIZE: str(entries), NCCL_ENABLE_TIMING_ENV: "1"}
    applied = {name: value for name, value in wanted.items() if name not in environ}
    environ.update(applied)
    return applied


def _default_dump() -> bytes:
    try:
        return torch_compat.dump_flight_recorder()
    except torch_compat.TorchCompatError as exc:
        raise TraceFormatError(str(exc)) from exc


@dataclass(frozen=True, slots=True)
class TracedCollective:
    """One finished, timed collective of the traced process group."""

    record_id: int
    """The recorder's number of the collective (all process groups of the process count)."""
    created_ns: int
    """Wall-clock time (``time.time_ns()`` scale) when the host launched it."""
    nbytes: int
    """Bytes of its input tensors."""
    duration_s: float
    """GPU time of the collective's kernel (start to end event on the communication stream)."""
    thread_id: int | None
    """The launching thread's ``threading.get_ident()``, when the recorder wrote a number."""


def entry_nbytes(entry: Mapping[str, Any]) -> int:
    """Bytes of an entry's input tensors (sizes times dtype width).

    Raises:
        TraceFormatError: sizes and dtypes disagree, or a dtype name is unknown.
    """
    sizes, dtypes = entry.get("input_sizes"), entry.get("input_dtypes")
    if not isinstance(sizes, list) or not isinstance(dtypes, list) or len(sizes) != len(dtypes):
        raise TraceFormatError(f"record {entry.get('record_id')}: input_sizes {sizes!r} do not match "
                               f"input_dtypes {dtypes!r}")  # fmt: skip
    total = 0
    for shape, dtype in zip(sizes, dtypes, strict=True):
        width = _DTYPE_BYTES.get(dtype)
        if width is None:
            raise TraceFormatError(f"record {entry.get('record_id')}: unknown dtype {dtype!r}")
        total += math.prod(shape) * width
    return total


class CollectiveTrace:
    """Reads one process group's finished collectives of one kind from the flight recorder.

    Args:
        group_name: the process group's name (``ProcessGroup.group_name``; "0" for the default
            group), as the recorder writes it in ``process_group[0]``.
        op: the collective, as in the recorder's ``profiling_name`` after the backend
            ("all_reduce" matches "nccl:all_reduce").
        dump: the recorder's dump; injectable for tests.

    Attributes:
        lost: collectives (of any group) overwritten in the ring before a read got to them.
        newest_record: the highest record number in the last dump (-1 before any): how many
            collectives all groups have launched, for pacing the reads.
        reads: dumps read so far.
        unparsed: collectives of this group and kind whose sizes or dtypes this reader does not
            know (passed over).
        untimed: collectives of this group and kind that finished without a duration (timing off).
    """

    def __init__(
        self, group_name: str, *, op: str = "all_reduce", dump: Dump = _default_dump
    ) -> None:
        self.group_name = group_name
        self.op = op
        self._suffix = ":" + op
        self._dump = dump
        self._last_record = -1  # every record up to this one has been returned or passed over
        self._held: int | None = None  # a retired record the last read stopped at, untimed
        self.lost = 0
        self.newest_record = -1
        self.reads = 0
        self.unparsed = 0
        self.untimed = 0

    def _ours(self, entry: Mapping[str, Any]) -> bool:
        group = entry.get("process_group")
        return (
            not entry.get("is_p2p", False)
            and isinstance(group, (list, tuple)) and bool(group) and group[0] == self.group_name
            and str(entry.get("profiling_name", "")).endswith(self._suffix)
        )  # fmt: skip

    def read(self) -> list[TracedCollective]:
        """The group's collectives of this kind that finished since the last read, in launch order.

        Stops at the first one still running (it and everything after it come with a later read),
        so each collective is returned once. Never waits for a collective.

        Raises:
            TraceFormatError: the dump is not a flight recorder dump this reader knows.
        """
        self.reads += 1
        try:
            dump = pickle.loads(self._dump())
            entries = sorted((e for e in dump.get("entries", []) if e["record_id"] > self._last_record),
                             key=lambda e: e["record_id"])  # fmt: skip
        except (pickle.UnpicklingError, AttributeError, KeyError, TypeError) as exc:
            raise TraceFormatError(f"the flight recorder's dump is not readable: {exc}") from exc
        if entries:
            self.newest_record = max(self.newest_record, entries[-1]["record_id"])
            if self._last_record >= 0:
                self.lost += entries[0]["record_id"] - self._last_record - 1
        found: list[TracedCollective] = []
        held, self._held = self._held, None
        for entry in entries:
            record = entry["record_id"]
            if self._ours(entry):
                duration_ms = entry.get("duration_ms")
                if duration_ms is not None:
                    try:
                        found.append(self._parse(entry, float(duration_ms)))
                    except (TraceFormatError, TypeError, ValueError):
                        self.unparsed += 1  # e.g. a dtype newer than this reader
                elif entry.get("retired", False) and (
                    entry.get("state") != "completed" or record == held
                ):
                    # Finished without a duration: a backend that times nothing (gloo records
                    # its collectives but never sees them complete), or timing off.
                    self.untimed += 1
                else:
                    # Still running; or retired but not timed yet: the recorder marks an entry
                    # retired before it computes the duration, outside its lock. One more read.
                    self._held = record if entry.get("retired", False) else None
                    break
            self._last_record = record
        return found

    def _parse(self, entry: Mapping[str, Any], duration_ms: float) -> TracedCollective:
        raw_thread = entry.get("thread_id")
        try:
            thread_id = int(raw_thread) if raw_thread is not None else None
        except (TypeError, ValueError):
            thread_id = None
        return TracedCollective(
            record_id=int(entry["record_id"]),
            created_ns=int(entry.get("time_created_ns") or 0),
            nbytes=entry_nbytes(entry),
            duration_s=max(0.0, duration_ms) / 1000.0,
            thread_id=thread_id,
        )
