"""Audit log of consumed samples: JSON lines per rank per optimizer step.

Used to prove exactly-once data consumption across restarts (see :func:`committed_history`).
Each worker process writes its own file per generation, ``samples-rank{R}-pid{PID}.jsonl`` (a
process that healed in place into another generation continues in ``...-pid{PID}-{N}.jsonl``);
the first line of a file is a ``start`` record naming the step the generation resumed from. A ``step`` record (the
step's indices) is written when the step *starts*, before any rank can commit it, so every
committed step has every rank's record whoever checkpointed it; a ``done`` record follows the
step's update (it tells how far a process got, e.g. for counting steps lost).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO


class SampleLog:
    """Appends records for one worker process, flushed line by line."""

    def __init__(
        self, directory: str | os.PathLike[str], *, rank: int, pid: int | None = None, part: int = 0
    ) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        suffix = f"-{part}" if part else ""
        self.path = (
            path / f"samples-rank{rank:04d}-pid{os.getpid() if pid is None else pid}{suffix}.jsonl"
        )
        self._file: TextIO = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def start(
        self,
        *,
        generation: str,
        started_unix: float,
        resumed_step: int,
        world_size: int,
        rank: int,
        source: str = "checkpoint",
    ) -> None:
        """``generation`` and ``started_unix`` are rank 0's, shared by the whole worker group.
        ``source``: where the state came from (``checkpoint``, or ``peer`` after an in-place heal)."""
        self._write(
            {
                "event": "start",
                "generation": generation,
                "started_unix": started_unix,
                "resumed_step": resumed_step,
                "world_size": world_size,
                "rank": rank,
                "source": source,
            }
        )

    def step(
        self, *, step: int, epoch: int, cursor: int, world_size: int, rank: int, indices: list[int]
    ) -> None:
        """``step`` is the number of optimizer steps done after this one."""
        self._write(
            {
                "event": "step",
                "step": step,
                "epoch": epoch,
                "cursor": cursor,
                "world_size": world_size,
                "rank": rank,
                "indices": indices,
            }
        )

    def done(self, *, step: int) -> None:
        """This process applied the update of ``step`` (at unix time ``t``)."""
        self._write({"event": "done", "step": step, "t": time.time()})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def read_records(directory: str | os.PathLike[str]) -> list[list[dict[str, Any]]]:
    """Every process's records, one list per file (a torn last line from a SIGKILL is dropped)."""
    return [records for _, records in _logs(directory)]


def _logs(directory: str | os.PathLike[str]) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    """Each process's file and its records, files without a record left out."""
    for path in sorted(Path(directory).glob("samples-rank*-pid*.jsonl")):
        records = read_records_of(path)
        if records:
            yield path, records


def committed_history(processes: Iterable[list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    """The steps that made it into the final model: ``{step: [records of every rank]}``.

    Every (re)start of the worker group is a *generation* (one id and start time, chosen by rank 0).
    A generation resumes from a checkpoint of step ``s`` and redoes the steps after ``s``: those
    steps' records from earlier generations were rolled back and are replaced by its own. A
    generation that started no step rolled nothing back: whatever state it loaded was never
    trained on, and the generation after it resumes from its own state (after an in-place heal,
    perhaps a peer's that still holds those steps) and rolls back for itself.
    """
    generations: dict[str, tuple[float, int, list[list[dict[str, Any]]]]] = {}
    for records in processes:
        start = records[0]
        steps = [r for r in records[1:] if r["event"] == "step"]  # "done" records are progress only
        started, resumed, group = generations.setdefault(
            start["generation"], (start["started_unix"], start["resumed_step"], [])
        )
        group.append(steps)
    history: dict[int, list[dict[str, Any]]] = {}
    for _started, resumed, group in sorted(generations.values(), key=lambda g: g[0]):
        if not any(group):
            continue
        for step in [s for s in history if s > resumed]:
            del history[step]
        for steps in group:
            for record in steps:
                history.setdefault(record["step"], []).append(record)
    return history


@dataclass
class Generation:
    """One (re)start of a worker group, as its sample logs tell it."""

    id: str
    started_unix: float
    resumed_step: int
    world_size: int
    last_step: int
    """Highest step any rank of this generation completed (``resumed_step`` if none)."""
    pids: dict[int, int] = field(default_factory=dict)
    """rank -> worker pid."""
    done_times: dict[int, float] = field(default_factory=dict)
    """step -> unix time the first rank completed it."""


def generations(directory: str | os.PathLike[str]) -> list[Generation]:
    """Every generation recorded in ``directory``, oldest first."""
    found: dict[str, Generation] = {}
    for path, records in _logs(directory):
        start = records[0]
        gen = found.setdefault(
            start["generation"],
            Generation(
                id=start["generation"],
                started_unix=start["started_unix"],
                resumed_step=start["resumed_step"],
                world_size=start["world_size"],
                last_step=start["resumed_step"],
            ),
        )
        gen.pids[start["rank"]] = pid_of(path)
        for record in records[1:]:
            if record["event"] == "done":
                gen.last_step = max(gen.last_step, record["step"])
                if "t" in record:
                    gen.done_times[record["step"]] = min(
                        gen.done_times.get(record["step"], record["t"]), record["t"]
                    )
    return sorted(found.values(), key=lambda g: g.started_unix)


def pid_of(path: str | os.PathLike[str]) -> int:
    """The process id in a sample log's file name."""
    return int(Path(path).stem.rsplit("-pid", 1)[1].split("-")[0])


def read_records_of(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """One process's records (a torn last line from a SIGKILL is dropped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records
