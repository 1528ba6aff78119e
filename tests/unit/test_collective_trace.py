"""The flight recorder reader: on hand-made dumps, and on the real recorder of a gloo process."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_trainer.metrics.collective_trace import (
    NCCL_ENABLE_TIMING_ENV,
    CollectiveTrace,
    TraceFormatError,
    entry_nbytes,
    trace_environment,
)
from elastic_trainer.runtime.settings import ENV_FR_BUFFER_SIZE

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def entry(record: int, *, group: str = "0", op: str = "nccl:all_reduce", ms: float | None = 1.0,
          retired: bool = True, state: str = "completed", sizes: Any = ((4,),),
          dtypes: Any = ("Float",)) -> dict[str, Any]:  # fmt: skip
    e: dict[str, Any] = {
        "record_id": record, "process_group": (group, "default_pg"), "profiling_name": op,
        "time_created_ns": 1_000 + record, "input_sizes": [list(s) for s in sizes],
        "input_dtypes": list(dtypes), "state": state, "retired": retired, "is_p2p": False,
        "thread_id": "140083515116416",
    }  # fmt: skip
    if ms is not None:
        e["duration_ms"] = ms
    return e


class Recorder:
    """A ring of entries, dumped the way torch pickles it."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def dump(self) -> bytes:
        return pickle.dumps({"version": "2.10", "entries": self.entries})


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    yield Recorder()


def test_returns_each_finished_collective_of_the_group_once_in_launch_order(
    recorder: Recorder,
) -> None:
    trace = CollectiveTrace("0", dump=recorder.dump)
    recorder.entries = [
        entry(1, ms=2.5, sizes=[(8, 4)], dtypes=["BFloat16"]),
        entry(0, ms=1.0),  # dumps come in ring order: sorted by record id
        entry(2, group="1"),  # another group
        entry(3, op="nccl:broadcast"),  # another collective
        entry(4, ms=0.5),
    ]
    got = trace.read()
    assert [(c.record_id, c.nbytes, c.duration_s) for c in got] == [
        (0, 16, 0.001),
        (1, 64, 0.0025),
        (4, 16, 0.0005),
    ]
    assert got[0].created_ns == 1_000 and got[0].thread_id == 140083515116416
    assert trace.read() == []  # nothing new
    recorder.entries.append(entry(5, ms=3.0))
    assert [c.record_id for c in trace.read()] == [5]
    assert trace.lost == 0 and trace.untimed == 0


def test_stops_at_a_running_collective_and_resumes_there(recorder: Recorder) -> None:
    trace = CollectiveTrace("0", dump=recorder.dump)
    running = entry(1, ms=None, retired=False, state="started")
    recorder.entries = [entry(0), running, entry(2)]
    assert [c.record_id for c in trace.read()] == [0]
    assert [c.record_id for c in trace.read()] == []  # still running: nothing after it either
    running.update(duration_ms=4.0, retired=True, state="completed")
    assert [c.record_id for c in trace.read()] == [1, 2]


def test_a_retired_entry_gets_one_more_read_to_receive_its_duration(recorder: Recorder) -> None:
    """The recorder marks an entry retired before it computes the duration (outside its lock):
    the first read waits at it; if the duration is still missing a read later, timing is off."""
    trace = CollectiveTrace("0", dump=recorder.dump)
    late = entry(0, ms=None)
    recorder.entries = [late, entry(1)]
    assert trace.read() == []
    late["duration_ms"] = 1.0
    assert [c.record_id for c in trace.read()] == [0, 1]

    recorder.entries = [entry(2, ms=None), entry(3)]
    assert trace.read() == []
    assert [c.record_id for c in trace.read()] == [3]  # the same entry again: untimed
    assert trace.untimed == 1


def test_gloo_entries_never_complete_and_count_as_untimed(recorder: Recorder) -> None:
    trace = CollectiveTrace("0", dump=recorder.dump)
    recorder.entries = [
        entry(i, op="gloo:all_reduce", ms=None, state="scheduled") for i in range(3)
    ]
    assert trace.read() == []
    assert trace.untimed == 3


def test_counts_collectives_the_ring_overwrote_before_a_read(recorder: Recorder) -> None:
    trace = CollectiveTrace("0", dump=recorder.dump)
    recorder.entries = [entry(0), entry(1)]
    trace.read()
    recorder.entries = [entry(5), entry(6)]  # 2, 3 and 4 came and went between reads
    assert [c.record_id for c in trace.read()] == [5, 6]
    assert trace.lost == 3 and trace.newest_record == 6 and trace.reads == 2


def test_bytes_are_sizes_times_dtype_width() -> None:
    assert (
        entry_nbytes(entry(0, sizes=[(3, 5), (2,)], dtypes=["Half", "Double"])) == 3 * 5 * 2 + 2 * 8
    )
    assert entry_nbytes(entry(0, sizes=[()], dtypes=["Long"])) == 8  # a scalar
    with pytest.raises(TraceFormatError, match="unknown dtype 'Quux'"):
        entry_nbytes(entry(0, dtypes=["Quux"]))
    with pytest.raises(TraceFormatError, match="do not match"):
        entry_nbytes(entry(0, sizes=[(1,), (2,)], dtypes=["Float"]))


def test_a_collective_of_an_unknown_dtype_is_passed_over(recorder: Recorder) -> None:
    trace = CollectiveTrace("0", dump=recorder.dump)
    recorder.entries = [entry(0, dtypes=["Float4_e2m1fn_x2"]), entry(1)]
    assert [c.record_id for c in trace.read()] == [1]
    assert trace.unparsed == 1


def test_an_unreadable_dump_is_a_clear_error() -> None:
    with pytest.raises(TraceFormatError, match="not readable"):
        CollectiveTrace("0", dump=lambda: b"not a pickle").read()
    with pytest.raises(TraceFormatError, match="not readable"):
        CollectiveTrace("0", dump=lambda: pickle.dumps({"entries": [{"no": "record id"}]})).read()


def test_trace_environment_keeps_what_the_user_set() -> None:
    environ = {ENV_FR_BUFFER_SIZE: "0"}
    assert trace_environment(environ, entries=64) == {NCCL_ENABLE_TIMING_ENV: "1"}
    assert environ == {ENV_FR_BUFFER_SIZE: "0", NCCL_ENABLE_TIMING_ENV: "1"}
    environ = {}
    trace_environment(environ, entries=64)
    assert environ[ENV_FR_BUFFER_SIZE] == "64"
    with pytest.raises(ValueError, match="entries"):
        trace_environment({}, entries=0)


REAL_RECORDER = """
import json, os, pickle, sys, threading, time
from elastic_trainer.metrics.collective_trace import CollectiveTrace, trace_environment, _default_dump
trace_environment(os.environ, entries=64)
import torch, torch.distributed as dist
from elastic_trainer.runtime.process_exit import exit_process
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
other = dist.new_group([0])
plain, timed = CollectiveTrace("0"), CollectiveTrace("0", dump=lambda: pickle.dumps(with_durations()))

def with_durations():  # what NCCL adds and gloo cannot: a duration on every retired entry
    dump = pickle.loads(_default_dump())
    for e in dump["entries"]:
        e["duration_ms"] = 2.0
    return dump

def retired():  # gloo retires an entry on its own thread, a moment after the call returns
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(e.get("retired") for e in pickle.loads(_default_dump())["entries"]):
        time.sleep(0.01)

start_ns = time.time_ns()
dist.all_reduce(torch.ones(3, 5))
dist.all_reduce(torch.ones(7, dtype=torch.bfloat16))
dist.broadcast(torch.ones(2), src=0)
dist.all_reduce(torch.ones(4), group=other)
retired()  # what the first reads see must not depend on how soon gloo's thread retired them
first = timed.read()
plain_first = plain.read()
for _ in range(100):  # the other group's collectives overwrite the 64-entry ring
    dist.all_reduce(torch.ones(1), group=other)
dist.all_reduce(torch.ones(11, dtype=torch.float64))
end_ns = time.time_ns()
retired()
got = first + timed.read()
print(json.dumps({
    "name": other.group_name != "0", "untimed": [len(plain_first + plain.read()), plain.untimed],
    "bytes": [c.nbytes for c in got], "ms": [c.duration_s * 1000 for c in got],
    "thread": all(c.thread_id == threading.get_ident() for c in got),
    "in_time": all(start_ns <= c.created_ns <= end_ns for c in got),
    "lost": timed.lost, "ring": len(with_durations()["entries"]),
}), flush=True)
exit_process(0)
"""


def test_reads_the_real_flight_recorder_of_a_gloo_process() -> None:
    """The real recorder's dump and field names. gloo records collectives but never their durations,
    so a second reader adds one to each entry, as NCCL's watchdog does with timing on."""
    proc = subprocess.run([sys.executable, "-c", REAL_RECORDER], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # 101 collectives between the two reads (100 of the other group), 64 still in the ring: 37 lost.
    assert result == {
        "name": True,
        "untimed": [0, 3],
        "bytes": [3 * 5 * 4, 7 * 2, 11 * 8],
        "ms": [2.0] * 3,
        "thread": True,
        "in_time": True,
        "lost": 37,
        "ring": 64,
    }, result
