"""The just-in-time save of a sharded loop: the survivors of a fault write every shard they hold,
a lost rank's from its neighbour copy, as one sharded checkpoint of the last completed step.

    saver = ShardedJit(checkpointer, state, copies, extras=lambda step, part: {...})
    saver.write(step, live=True)       # on the training thread, after a peer's death

A sharded checkpoint needs every rank's shards, and a SIGKILLed rank's are gone from its memory;
but its neighbour holds a copy of them in host memory (``state/neighbour_copy.py``). So each
survivor writes, without a collective, a *part* for every shard it holds at a step: its own
(staged by the copy, or the live state on the training thread) and each neighbour copy it
received. A part is a DCP checkpoint of one shard written as if its rank had written it: the same
names (``ShardedState.checkpoint_state``) and each tensor placed at that rank's rows of the global
tensor (:class:`PlacedSavePlanner`; FSDP2's ``torch.chunk`` rows on dim 0), so the merged
checkpoint is the one a collective save writes and loads resharded at any world size. Parts go to
``step``'s just-in-time directory (``sharded.jit_path``) as ``rank-<shard>/``
(``sharded.write_part``: renamed into place whole, the first writer of a shard wins, another's
copy is dropped) with a ``rank-<shard>.done`` marker; the writer whose part completes the set
merges and commits it (``sharded.commit_parts``: hashes, fence, rename, manifest with
``jit: true``).

Which step: the ranks cannot agree (the group is broken), and a rank that finished step ``S+1``
while its peer died inside it holds ``S`` only as its staged copy's previous generation. So each
rank writes what it holds for every step newer than the newest checkpoint, newest first, and
stops once a checkpoint of that step is committed: the newest step whose every shard survived
somewhere is committed. A shard whose rank and holder were both lost leaves every set
incomplete; the next start names it in one line (:func:`describe_incomplete`) and resumes from the
newest periodic checkpoint. Design: ``docs/design/sharded.md`` ("The just-in-time save").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint.sharded import (
    ShardedCheckpointer,
    commit_parts,
    jit_path,
    write_part,
)
from elastic_trainer.runtime.failures import log_line
from elastic_trainer.state.local_shards import DIM0
from elastic_trainer.state.neighbour_copy import NO_STATE, NeighbourCopy
from elastic_trainer.state.reshard import chunk_rows
from elastic_trainer.state.sharded import ShardedState

log = logging.getLogger(__name__)

Placed = Mapping[int, tuple[torch.Size, torch.Size]]
"""``id(tensor)`` -> (the global size, this piece's offsets in it)."""

_JIT_DIR_RE = re.compile(r"^\.ckpt-(\d{12})\.dcp\.tmp-\d+$")
_DONE_RE = re.compile(r"^rank-(\d+)\.done$")


class PlacedSavePlanner(DefaultSavePlanner):
    """DCP's save planner, with some plain tensors written as pieces of a larger tensor: what a
    DTensor's own write item says (``type SHARD``, the chunk's offsets, the global size), for a
    shard whose DTensor lives in another process (a neighbour copy of a lost rank).

    Args:
        placed: ``id`` of each such tensor in the state dict -> (global size, offsets).
    """

    def __init__(self, placed: Placed) -> None:
        super().__init__()
        self._placed = dict(placed)

    def _where(self, fqn: str) -> tuple[torch.Size, torch.Size] | None:
        value = self.state_dict.get(fqn)
        return self._placed.get(id(value)) if isinstance(value, torch.Tensor) else None

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            where = self._where(item.index.fqn)
            if where is not None and item.tensor_data is not None:
                size, offsets = where
                item = WriteItem(
                    index=MetadataIndex(item.index.fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=item.tensor_data.size),
                        properties=item.tensor_data.properties,
                        size=size,
                    ),
                )
            items.append(item)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if self._where(index.fqn) is not None:
            return self.state_dict[index.fqn]  # the piece itself, at its offsets
        return super().lookup_object(index)


def place(
    shapes: Mapping[int, tuple[list[int], str]],
    tensors: Mapping[int, torch.Tensor],
    *,
    shard: int,
    world_size: int,
) -> dict[int, tuple[torch.Size, torch.Size]]:
    """Where shard ``shard`` of ``world_size`` puts each of its local tensors (by ``id``): FSDP2's
    ``torch.chunk`` rows on dim 0 (``reshard.chunk_rows``), the offsets DCP records for them.

    Raises:
        ValueError: a tensor is placed otherwise (HSDP's 2-D mesh, tensor parallel), or its rows
            are not that rank's.
    """
    placed: dict[int, tuple[torch.Size, torch.Size]] = {}
    for key, (shape, placement) in shapes.items():
        if placement != DIM0 or not shape:
            raise ValueError(f"a shard placed {placement}, not on dim 0 of a 1-D mesh")
        start, stop = chunk_rows(int(shape[0]), world_size, shard)
        local = tensors[key]
        if local.dim() != len(shape) or local.shape[0] != stop - start:
            raise ValueError(
                f"a shard of {tuple(local.shape)} is not rank {shard}'s rows of {tuple(shape)}"
            )
        placed[key] = (torch.Size(shape), torch.Size([start] + [0] * (len(shape) - 1)))
    return placed


def _tensors(value: Any, found: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        found[id(value)] = value
    elif isinstance(value, Mapping):
        for item in value.values():
            _tensors(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found)
    return found


def part_epoch(part: Mapping[str, Any], default: int) -> int:
    """The epoch of a part's step: its sampler's (an object whose state holds an integer
    ``epoch``), else ``default``."""
    return next(
        (
            int(value["epoch"])
            for name, value in part.items()
            if name not in ("model", "optimizer")
            and isinstance(value, Mapping)
            and isinstance(value.get("epoch"), int)
        ),
        default,
    )


def written_just_in_time(path: Path) -> bool:
    """Whether the checkpoint at ``path`` (its manifest says) was written just in time."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        return ckpt.Manifest.from_json(path.with_suffix(".json").read_text()).jit
    return False


def describe_incomplete(directory: str | os.PathLike[str], newest: int | None) -> str | None:
    """(At a start, before the temporary directories are removed) one line about the newest
    just-in-time set newer than the checkpoint of step ``newest`` that never completed: which
    ranks' shards of that step survived nowhere (neither the rank nor its neighbour copy held
    them), and the steps redone. ``None`` when there is none."""
    found: list[tuple[int, dict[int, dict[str, Any]]]] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            match = _JIT_DIR_RE.match(entry.name)
            if match is None or not entry.is_dir():
                continue
            step = int(match.group(1))
            if newest is not None and step <= newest:
                continue
            parts: dict[int, dict[str, Any]] = {}
            for marker in os.scandir(entry.path):
                done = _DONE_RE.match(marker.name)
                if done is None:
                    continue
                try:
                    parts[int(done.group(1))] = json.loads(Path(marker.path).read_text() or "{}")
                except (OSError, ValueError):
                    parts[int(done.group(1))] = {}
            if parts:
                found.append((step, parts))
    if not found:
        return None
    step, parts = max(found, key=lambda item: item[0])
    worlds = {p.get("world_size") for p in parts.values() if isinstance(p.get("world_size"), int)}
    missing = (
        sorted(set(range(int(next(iter(worlds)) or 0))) - set(parts)) if len(worlds) == 1 else []
    )
    if len(worlds) == 1 and not missing:
        return None  # complete but not committed: its committer died; no shard was lost
    lost = (
        f"rank(s) {', '.join(str(r) for r in missing)}'s shards of it survived nowhere (neither "
        "the rank nor its neighbour copy held them)"
        if missing
        else "its parts are of different world sizes"
    )
    since = "scratch" if newest is None else f"step {newest}"
    redone = step if newest is None else step - newest
    return (
        f"the just-in-time checkpoint of step {step} is incomplete: {lost}; resuming from "
        f"{since}: {redone} step(s) redone"
    )


class ShardedJit:
    """Writes every shard this rank holds as parts of a just-in-time checkpoint (see the module
    docstring); called once, by :class:`~.jit.JustInTime`, which serializes and bounds the save.

    Args:
        checkpointer: the job's sharded checkpointer (directory, token, fingerprint, fence).
        state: the sharded state (the names; take ``state.checkpoint_names()`` on the training
            thread before a save can start on another one).
        copies: this rank's neighbour copy (its staged steps and the copies it received).
        extras: ``extras(step, part)``: the checkpoint's other entries of ``step`` (format, step,
            epoch, ...), ``part`` being a part's state in the shape of ``state.state_dict()``.
    """

    def __init__(
        self,
        checkpointer: ShardedCheckpointer,
        state: ShardedState,
        copies: NeighbourCopy,
        *,
        extras: Callable[[int, Mapping[str, Any]], dict[str, Any]],
    ) -> None:
        self.checkpointer = checkpointer
        self.state = state
        self.copies = copies
        self.extras = extras

    def write(self, step: int, *, live: bool) -> str:
        """Write the parts after the group failed at ``step``: of ``step``, or of the step before
        it where the dead rank's last copy was cut. Returns where the checkpoint went, or what
        this rank wrote while the set is incomplete. ``live``: on the training thread, the live
        state may stand in for this rank's shard when no staged copy holds its step (the copy
        off, or refreshed every N > 1 steps); on another thread (a stalled stop, the healer's stop
        watch) the copy is stopped first, so that the training thread stages nothing new while
        the staged copies are written."""
        if not live:
            self.copies.stop()
        done, path, detail = self._save(f"the group failed after step {step}", live=live)
        if path is not None and done == step:
            return path
        if path is not None:
            return f"{path} (step {done}: the lost rank's copy of {step} was cut)"
        return (
            f"{jit_path(self.checkpointer.directory, step, self.checkpointer.token)} (the "
            f"shards this rank holds: {detail}; the checkpoint counts once every rank's "
            "are in)"
        )

    def _sources(self, live: bool) -> dict[int, dict[int, str]]:
        """step -> shard -> what this rank holds of it (``own``, ``copy`` or ``live``)."""
        held = self.copies.holdings()
        sources: dict[int, dict[int, str]] = {}
        for step in held.own:
            sources.setdefault(step, {})[held.rank] = "own"
        if live and held.live != NO_STATE and held.live not in held.own:
            sources.setdefault(held.live, {})[held.rank] = "live"
        for shard, step in held.copies:
            sources.setdefault(step, {}).setdefault(shard, "copy")
        return sources

    def _save(self, reason: str, *, live: bool) -> tuple[int | None, str | None, str]:
        """(the step committed or tried, its checkpoint's path if committed, what happened)"""
        started = time.monotonic()
        directory = self.checkpointer.directory
        sources = self._sources(live)
        newest = ckpt.newest_step(directory)
        steps = sorted((s for s in sources if newest is None or s > newest), reverse=True)
        if not steps:
            why = (
                f"a checkpoint of step {newest} holds every step this rank holds"
                if sources
                else "this rank holds no completed step in host memory (the copy is off)"
            )
            log.info("just-in-time save skipped: %s", why)
            return None, None, why
        written: list[str] = []
        for step in steps:
            folder = jit_path(directory, step, self.checkpointer.token)
            epoch = self._write_parts(folder, step, sources[step], written)
            committed = self._commit(folder, step, epoch)
            done = step if committed is not None else ckpt.newest_step(directory)
            if done is not None and done >= step:
                took = time.monotonic() - started
                log.warning(
                    "just-in-time checkpoint of step %d committed %s (%s); this rank wrote the "
                    "shards of %s",
                    done,
                    f"to {committed} in {took:.2f} s" if committed else "by another rank",
                    reason,
                    "; ".join(written) or ("no rank (all were in)" if committed else "no rank"),
                )
                return done, committed or str(ckpt.sharded_path(directory, done)), reason
        log.warning(
            "just-in-time save (%s): this rank wrote the shards of %s; the checkpoint counts once "
            "every rank's shards of one step are in",
            reason,
            "; ".join(written) or "no rank",
        )
        return steps[0], None, "parts written"

    def _write_parts(
        self, folder: Path, step: int, shards: Mapping[int, str], written: list[str]
    ) -> int:
        """Write a part for each shard this rank holds of ``step`` (what: ``own``, ``copy`` or
        ``live``) until a checkpoint of it is committed; each written is added to ``written``.
        Returns the step's epoch (0 when no part was read)."""
        directory = self.checkpointer.directory
        rank, world = self.copies.env.rank, self.copies.env.world_size
        epoch: int | None = None
        for shard, what in sorted(shards.items()):
            if (ckpt.newest_step(directory) or -1) >= step:
                break
            try:
                payload = self.copies.payload(
                    "live" if what == "live" else what, shard=shard, step=step
                )
                part, shapes = self.state.checkpoint_state(payload)
                placed = place(shapes, _tensors(part, {}), shard=shard, world_size=world)
                part.update(self.extras(step, part))
                if epoch is None:
                    epoch = int(part.get("epoch", 0))
                planner = PlacedSavePlanner(placed)
                if write_part(
                    folder,
                    part,
                    shard=shard,
                    world_size=world,
                    writer=rank,
                    source=what,
                    planner=planner,
                ):
                    written.append(f"rank {shard}'s of step {step} ({_SOURCE[what]})")
            except LookupError:
                continue  # overwritten since the holdings were read: a newer one is written
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - one line, go on
                log.error(
                    "just-in-time save: rank %d's shards of step %d not written: %s",
                    shard,
                    step,
                    log_line(exc),
                )
                continue
        return epoch if epoch is not None else 0

    def _commit(self, folder: Path, step: int, epoch: int) -> str | None:
        try:
            info = commit_parts(
                self.checkpointer.directory,
                folder,
                step=step,
                epoch=epoch,
                world_size=self.copies.env.world_size,
                fingerprint_fields=self.checkpointer.fingerprint_fields,
                fence=self.checkpointer.fence,
            )
        except ckpt.CheckpointError as exc:
            log.error("just-in-time checkpoint of step %d not committed: %s", step, exc)
            return None
        return None if info is None else str(info.path)


_SOURCE = {"own": "its staged copy", "live": "its live state", "copy": "the neighbour copy"}
