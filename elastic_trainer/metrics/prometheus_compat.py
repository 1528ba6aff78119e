"""Every use of a private prometheus-client API, in one place. Checked against prometheus-client 0.26.0.

The public API has no way to ask which value class was chosen at import, to add many observations
to a histogram child at once, to fold a dead process's multiprocess files into one, or to merge
only some families of them. The rest
of the package calls the functions here for that, so an upgrade means checking this one file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import values
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

CHECKED_PROMETHEUS_CLIENT = "0.26.0"
"""The prometheus-client version every entry below was checked against."""


def multiprocess_values() -> bool:
    """Whether this process's metric values live in the multiprocess files: prometheus-client
    chooses ``values.ValueClass`` once, at import, from ``PROMETHEUS_MULTIPROC_DIR``; the
    in-memory choice is ``values.MutexValue``."""
    return values.ValueClass is not values.MutexValue


def histogram_parts(child: Any) -> tuple[Sequence[float], Sequence[Any], Any] | None:
    """A histogram child's upper bounds (ending with +Inf), its per-bucket values
    (non-cumulative, each with ``inc``) and its ``_sum`` value; ``None`` if the child lacks
    ``_upper_bounds``/``_buckets``/``_sum``."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        return None
    return bounds, buckets, total


# -- the multiprocess directory's files (MultiProcessCollector's format) ------------------------

_PID_FILE = re.compile(r"^(counter|histogram|summary|gauge_[a-z]+)_(\d+)\.db$")


def pid_file(filename: str) -> tuple[str, int] | None:
    """``(kind, pid)`` of a process's value file (``counter_123.db``, ``gauge_max_123.db``, ...);
    ``None`` for any other name."""
    match = _PID_FILE.match(filename)
    return (match.group(1), int(match.group(2))) if match else None


def db_file_name(kind: str, tag: str) -> str:
    """The name of a value file of ``kind`` that the collector reads: it takes the kind from the
    name's prefix and reads every ``*.db`` file, whatever stands where the pid would."""
    return f"{kind}_{tag}.db"


Value = tuple[float, float]
"""(value, timestamp) of one series in one file."""


def _latest(a: Value, b: Value) -> Value:
    return a if a[1] >= b[1] else b


MERGE: dict[str, Callable[[Value, Value], Value]] = {
    "counter": lambda a, b: (a[0] + b[0], 0.0),
    "histogram": lambda a, b: (a[0] + b[0], 0.0),  # per-bucket counts and _sum
    "summary": lambda a, b: (a[0] + b[0], 0.0),
    "gauge_sum": lambda a, b: (a[0] + b[0], 0.0),
    "gauge_max": lambda a, b: (max(a[0], b[0]), 0.0),
    "gauge_min": lambda a, b: (min(a[0], b[0]), 0.0),
    "gauge_mostrecent": _latest,
}
"""How two files' values of one series combine, by file kind: what ``MultiProcessCollector``
does at scrape time. ``live*`` gauge kinds are absent: they are dropped with their process."""


def read_values(path: str) -> Iterator[tuple[str, float, float]]:
    """Every ``(series key, value, timestamp)`` of a value file."""
    for key, value, timestamp, _ in MmapedDict.read_all_values_from_file(path):
        yield key, value, timestamp


def write_values(path: str, items: Iterable[tuple[str, Value]]) -> None:
    """Write ``(series key, (value, timestamp))`` pairs to a new value file at ``path``."""
    out = MmapedDict(path)
    try:
        for key, (value, timestamp) in items:
            out.write_value(key, value, timestamp)
    finally:
        out.close()


class FamilyMerge:
    """``MultiProcessCollector.merge`` of only some families, for a reader that polls: a series
    key's JSON is parsed once and kept (the parse is most of a full merge), the other families'
    series are skipped before they are built, and only the families asked for are accumulated.
    What it returns for those families is what the full merge returns for them.

    Args:
        families: the family names to keep (``elastic_trainer_step``; a counter's without
            ``_total``, a histogram's without ``_bucket``/``_sum``/``_count``).
    """

    MAX_KEYS = 100_000
    """Parsed keys kept at the most (the cache starts again past it)."""

    def __init__(self, families: Iterable[str]) -> None:
        self.families = frozenset(families)
        self._keys: dict[str, tuple[str, str, tuple[tuple[str, str], ...], str] | None] = {}

    def merge(self, paths: Iterable[str]) -> Iterable[Metric]:
        """The kept families of the value files at ``paths`` (a file gone meanwhile is skipped)."""
        if len(self._keys) > self.MAX_KEYS:
            self._keys.clear()
        metrics: dict[str, Metric] = {}
        for path in paths:
            parts = os.path.basename(path).split("_")
            kind = parts[0]
            try:
                entries = MmapedDict.read_all_values_from_file(path)
            except FileNotFoundError:  # retired between the listing and now
                continue
            for key, value, timestamp, _ in entries:
                parsed = self._parse(key)
                if parsed is None:
                    continue
                family, name, labels, help_text = parsed
                metric = metrics.get(family)
                if metric is None:
                    metric = metrics[family] = Metric(family, help_text, kind)
                if kind == "gauge":
                    metric._multiprocess_mode = parts[1]  # type: ignore[attr-defined]
                    metric.add_sample(name, labels + (("pid", parts[2][:-3]),), value, timestamp)  # type: ignore[arg-type]
                else:
                    metric.add_sample(name, labels, value)  # type: ignore[arg-type]
        return MultiProcessCollector._accumulate_metrics(metrics, True)

    def _parse(self, key: str) -> tuple[str, str, tuple[tuple[str, str], ...], str] | None:
        try:
            return self._keys[key]
        except KeyError:
            family, name, labels, help_text = json.loads(key)
            parsed = (family, name, tuple(sorted(labels.items())), help_text)
            self._keys[key] = parsed if family in self.families else None
            return self._keys[key]
