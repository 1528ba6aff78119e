"""Sharded checkpoints: every rank writes its own shards with torch.distributed.checkpoint (DCP).

    ckpt-000000000100.dcp/    DCP's directory: .metadata and each rank's __<rank>_<n>.distcp
    ckpt-000000000100.json    the manifest of :mod:`.files`, with ``files`` = {name: [sha256, nbytes]}

A save is collective (every rank at the same step):

1. The previous write must have ended (its host buffers are reused): :meth:`ShardedCheckpointer.save`
   waits for it and re-raises its error.
2. Asynchronous (the default): the state is copied into reused host buffers
   (:class:`~.dcp_io.HostStager`, pinned where CUDA exists) on the training thread; that copy is
   all the training thread waits for. DCP writes the copy on a background thread over the
   checkpoint's own gloo group, into the hidden ``.ckpt-<S>.dcp.tmp-<token>``.
3. Rank 0, once DCP's save returned (every rank's shards and ``.metadata`` are durable), hashes the
   files, asks the commit fence, renames the directory into place and writes the manifest. A
   checkpoint counts only once its manifest is committed and every file matches it; a crash at
   any point leaves the new checkpoint complete or absent and earlier ones untouched.

The just-in-time save (after a failure, when the group may be broken) has no collective: each
rank writes its own shards into ``step``'s just-in-time directory as a DCP checkpoint of its own
(``rank-<r>/``) and marks them done; the rank that completes the set merges the parts' metadata
into one, renames the shard files into place and commits as above (:func:`commit_parts`). A set
that never completes (a rank died with its shards) is no checkpoint, and is removed at the next
start like any temporary directory.

Loading is collective too: DCP reads into the live state dict (DTensors of the current mesh), so a
checkpoint written at N ranks loads at M: resharding is DCP's planner. Choosing which checkpoint,
fallback past a damaged one, fingerprints, quarantine and pruning are those of :mod:`.files`, for
both formats. Design: ``docs/design/sharded.md``.

    elastic-trainer checkpoint export ./ckpt model.pt    # one plain file, weights_only=True
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.checkpoint.config import CheckpointConfig
from elastic_trainer.checkpoint.dcp_io import (
    METADATA_FILE,
    HostStager,
    SafeEmptyLoadPlanner,
    SafeLoadPlanner,
    SafeReader,
    checkpoint_group,
    read_metadata,
    save_in_this_process,
)
from elastic_trainer.runtime import torch_compat
from elastic_trainer.runtime.atomic_files import atomic_file, fsync_directory
from elastic_trainer.runtime.distributed import DistEnv

log = logging.getLogger(__name__)


def temp_path(directory: str | os.PathLike[str], step: int, token: int) -> Path:
    """The hidden directory DCP writes ``step``'s shards into before the commit; ``token`` is the
    same on every rank of one group and differs between groups (:func:`_group_token`)."""
    return Path(directory) / f".ckpt-{step:012d}.dcp.tmp-{token}"


def jit_path(directory: str | os.PathLike[str], step: int, token: int) -> Path:
    """The hidden directory the ranks' just-in-time parts of ``step`` go to (``token + 1``: never
    the directory of a periodic write of the same step that may still be in flight)."""
    return temp_path(directory, step, token + 1)


def _group_token(group: Any, world_size: int) -> int:
    """Collective: rank 0's random number, the same on every rank of this group. (Not torchrun's
    restart count: each node's agent counts its own restarts, so a node that joined later has
    another count, and its ranks would write their shards into another directory.)"""
    token = [secrets.randbits(48)]
    if world_size > 1:
        dist.broadcast_object_list(token, src=0, group=group)
    return int(token[0])


def local_nbytes(state: Any) -> int:
    """Bytes of tensor data this rank writes of ``state``: its local shard of each DTensor, each
    plain tensor (what a save reports as written by this rank)."""
    if isinstance(state, DTensor):
        local = state.to_local()
        return local.numel() * local.element_size()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(local_nbytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(local_nbytes(value) for value in state)
    return 0


class ShardedCheckpointer:
    """Writes (and loads) the sharded checkpoints of one job; every method is collective.

    Args:
        directory: the checkpoint directory every rank shares.
        rank: this rank (rank 0 commits).
        world_size: recorded in the manifest.
        fingerprint_fields: what identifies the job (see :func:`.files.check_fingerprint`).
        keep_last: checkpoints kept after a commit (``None``: prune nothing).
        fence: asked right before a commit (see :func:`.files.save_checkpoint`).
        group: the process group of the checkpoint's collectives; by default a new gloo group of
            all ranks (collective: every rank constructs its checkpointer at the same point).
        token: names the temporary directory; by default rank 0's random number (collective).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        rank: int,
        world_size: int,
        fingerprint_fields: Mapping[str, Any],
        keep_last: int | None,
        fence: ckpt.CommitFence | None = None,
        group: Any = None,
        token: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.fingerprint_fields = dict(fingerprint_fields)
        self.keep_last = keep_last
        self.fence = fence
        self.group = group if group is not None else checkpoint_group()
        self.token = _group_token(self.group, world_size) if token is None else token
        self.stager = HostStager()
        self.writer = ckpt.AsyncCheckpointWriter()

    @classmethod
    def for_job(
        cls,
        config: CheckpointConfig,
        *,
        env: DistEnv,
        fingerprint_fields: Mapping[str, Any],
        fence: ckpt.CommitFence | None = None,
    ) -> ShardedCheckpointer:
        """(Collective) the checkpointer of a job's checkpoint section, for this worker (what
        the checkpoint manager builds)."""
        if config.directory is None:
            raise ValueError("a sharded checkpointer needs a checkpoint directory")
        return cls(
            config.directory,
            rank=env.rank,
            world_size=env.world_size,
            fingerprint_fields=fingerprint_fields,
            keep_last=config.keep_last,
            fence=fence,
        )

    @property
    def busy(self) -> bool:
        """A background write is in flight."""
        return self.writer.busy

    def save(
        self, state: dict[str, Any], *, step: int, epoch: int, sync: bool = False, jit: bool = False
    ) -> ckpt.CheckpointInfo | None:
        """Write ``state`` (a DCP state dict: DTensors, tensors, plain data) as ``step``'s checkpoint.

        ``sync=False`` returns once the state is staged; :meth:`wait` (or the next save) reports
        the write. ``sync=True`` returns when it is committed: the checkpoint on rank 0, ``None``
        elsewhere.

        Raises:
            CheckpointWriteError: this write (``sync``) or the previous background write failed.
            CheckpointFencedError: (``sync``, rank 0) the fence refused the commit.
        """
        self.writer.wait()
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(self.directory, step, self.token)
        if sync:
            return self._write(state, tmp, step=step, epoch=epoch, jit=jit)
        staged = self.stager.stage(state)
        self.writer.submit(lambda: self._write(staged, tmp, step=step, epoch=epoch, jit=jit))
        return None

    def wait(self, timeout: float | None = None) -> ckpt.CheckpointInfo | None:
        """Wait for the background write; re-raise its error (see ``AsyncCheckpointWriter.wait``)."""
        return self.writer.wait(timeout)

    def _write(
        self, state: dict[str, Any], tmp: Path, *, step: int, epoch: int, jit: bool
    ) -> ckpt.CheckpointInfo | None:
        try:
            metadata = dcp.save(
                state,
                storage_writer=FileSystemWriter(tmp, sync_files=True, overwrite=True),
                process_group=self.group,
            )
        except (Exception, CheckpointException) as exc:  # DCP's error is a BaseException
            raise ckpt.write_error(self.directory, step, exc) from exc
        if self.rank != 0:
            return None
        return commit(
            self.directory,
            tmp,
            metadata,
            step=step,
            epoch=epoch,
            world_size=self.world_size,
            fingerprint_fields=self.fingerprint_fields,
            keep_last=self.keep_last,
            jit=jit,
            fence=self.fence,
        )

    def save_own(
        self, state: dict[str, Any], *, step: int, epoch: int
    ) -> ckpt.CheckpointInfo | None:
        """Without a collective (a just-in-time save: the group may be broken): write this rank's
        shards of ``state`` (a host copy) into ``step``'s just-in-time directory and mark them
        done; the rank whose part completes the set commits. Returns the checkpoint on that rank,
        ``None`` on the others (and while parts are missing).

        Raises:
            CheckpointWriteError: this rank's part or the commit failed.
            CheckpointFencedError: (the committing rank) the fence refused the commit.
        """
        folder = jit_path(self.directory, step, self.token)
        try:
            write_part(
                folder,
                state,
                shard=self.rank,
                world_size=self.world_size,
                writer=self.rank,
                source="live",
            )
        except (Exception, CheckpointException) as exc:  # DCP's error is a BaseException
            raise ckpt.write_error(self.directory, step, exc) from exc
        return commit_parts(
            self.directory,
            folder,
            step=step,
            epoch=epoch,
            world_size=self.world_size,
            fingerprint_fields=self.fingerprint_fields,
            fence=self.fence,
        )

    def load(self, info: ckpt.CheckpointInfo, state: dict[str, Any]) -> None:
        """Read ``info``'s checkpoint into ``state`` in place, resharded onto ``state``'s DTensors."""
        load_into(info.path, state, group=self.group)


def _listing(folder: Path, metadata: Metadata) -> dict[str, list[Any]]:
    """``{name: [sha256, nbytes]}`` of the files DCP wrote (its metadata names them); anything
    else in ``folder`` (an earlier attempt's) is deleted."""
    wanted = {METADATA_FILE} | {
        str(getattr(info, "relative_path", "")) for info in (metadata.storage_data or {}).values()
    }
    listing: dict[str, list[Any]] = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name not in wanted:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
            continue
        listing[entry.name] = list(ckpt.sha256_of(Path(entry.path)))
    missing = wanted - set(listing)
    if missing:
        raise FileNotFoundError(f"DCP reported files that are not in {folder}: {sorted(missing)}")
    return listing


def commit(
    directory: Path,
    tmp: Path,
    metadata: Metadata,
    *,
    step: int,
    epoch: int,
    world_size: int,
    fingerprint_fields: Mapping[str, Any],
    keep_last: int | None,
    jit: bool = False,
    fence: ckpt.CommitFence | None = None,
) -> ckpt.CheckpointInfo:
    """(Rank 0) make the DCP directory ``tmp`` the committed checkpoint of ``step``.

    Raises:
        CheckpointFencedError: ``fence`` refused; ``tmp`` is removed, nothing else changed.
        CheckpointWriteError: hashing, renaming or the manifest failed; earlier checkpoints stand.
    """
    final = ckpt.sharded_path(directory, step)
    try:
        listing = _listing(tmp, metadata)
        try:
            ckpt.ask_fence(fence, step)
        except ckpt.CheckpointFencedError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if ckpt.manifest_path(directory, step).exists():
            # Committed already (a just-in-time writer got there first): keep that one.
            shutil.rmtree(tmp, ignore_errors=True)
            return ckpt.verify(directory, step)
        if final.exists():
            shutil.rmtree(final)  # a directory without a manifest is an interrupted commit
        os.replace(tmp, final)
        fsync_directory(directory)
        text = json.dumps(listing, sort_keys=True).encode()
        manifest = ckpt.new_manifest(
            final.name,
            step=step,
            epoch=epoch,
            world_size=world_size,
            sha256=hashlib.sha256(text).hexdigest(),
            nbytes=sum(size for _, size in listing.values()),
            fingerprint_fields=fingerprint_fields,
            jit=jit,
            files=listing,
        )
        ckpt.write_manifest(directory, manifest)
    except ckpt.CheckpointError:
        raise
    except Exception as exc:
        raise ckpt.write_error(directory, step, exc) from exc
    if keep_last is not None:
        ckpt.prune(directory, keep_last)
    log.info(
        "%ssharded checkpoint of step %d written to %s (%d files, %.1f MB)",
        "just-in-time " if jit else "",
        step,
        final,
        len(listing),
        manifest.nbytes / 1e6,
    )
    return ckpt.CheckpointInfo(path=final, manifest=manifest)


def write_part(
    folder: Path,
    state: dict[str, Any],
    *,
    shard: int,
    world_size: int,
    writer: int,
    source: str,
    planner: Any = None,
) -> bool:
    """Write ``state`` (one shard's; ``planner``: DCP's save planner, e.g. ``sharded_jit``'s that
    places a neighbour copy's tensors) as the just-in-time part ``folder/rank-<shard>``, with no
    collective, and mark it done (``rank-<shard>.done``: the writer, the source and the world
    size, read by ``sharded_jit.describe_incomplete``). A part is renamed into place whole, so
    the first writer of a shard wins. Returns ``False`` when another writer's part of that shard
    was there first.

    Raises:
        OSError, CheckpointException: the write failed (nothing of it is left as the part).
    """
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f"rank-{shard}"
    wrote = False
    if not part.exists():
        tmp = folder / f".rank-{shard}.tmp-{writer}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_in_this_process(
                state,
                storage_writer=FileSystemWriter(tmp, sync_files=True, overwrite=True),
                planner=planner,
            )
            fsync_directory(tmp)
            os.rename(tmp, part)  # whole or not at all; fails if another writer's is there
            wrote = True
        except OSError:
            if not part.exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_directory(folder)
    marker = folder / f"rank-{shard}.done"
    if wrote or not marker.exists():
        record = {"writer": writer, "source": source, "world_size": world_size}
        with atomic_file(marker) as out:
            out.write(json.dumps(record).encode())
    return wrote


def commit_parts(
    directory: Path,
    folder: Path,
    *,
    step: int,
    epoch: int,
    world_size: int,
    fingerprint_fields: Mapping[str, Any],
    fence: ckpt.CommitFence | None = None,
) -> ckpt.CheckpointInfo | None:
    """If every rank's just-in-time part of ``step`` is in ``folder`` and no other rank is
    committing them: merge them into one DCP checkpoint and commit it (:func:`commit`). ``None``
    when parts are missing or another rank commits."""
    if not all((folder / f"rank-{r}.done").exists() for r in range(world_size)):
        return None
    try:
        fd = os.open(folder / "commit.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return None  # the other rank that completed the set at the same moment commits
    os.close(fd)
    try:
        metadata = _merge_parts(folder, world_size)
        with atomic_file(folder / METADATA_FILE) as out:
            pickle.dump(metadata, out)
        for entry in os.scandir(folder):  # the parts, and any writer's unfinished one
            if entry.is_dir(follow_symlinks=False):
                # A slower writer of a part that is in already may still be adding files to its
                # own temporary directory: what it leaves is in no metadata (_listing drops it).
                shutil.rmtree(entry.path, ignore_errors=True)
    except Exception as exc:
        raise ckpt.write_error(directory, step, exc) from exc
    return commit(
        directory,
        folder,
        metadata,
        step=step,
        epoch=epoch,
        world_size=world_size,
        fingerprint_fields=fingerprint_fields,
        keep_last=None,
        jit=True,
        fence=fence,
    )


def _merge_parts(folder: Path, world_size: int) -> Metadata:
    """One metadata for the ranks' parts (each a DCP checkpoint of one rank's shards): every
    rank's chunks of each tensor, replicated entries once (rank 0's); each part's files renamed to
    ``__<rank>_<n>.distcp`` in ``folder``."""
    merged: Metadata | None = None
    for r in range(world_size):
        part = folder / f"rank-{r}"
        metadata = read_metadata(part)
        names: dict[str, str] = {}
        storage = {}
        for index, info in (metadata.storage_data or {}).items():
            old = str(info.relative_path)
            new = names.setdefault(old, f"__{r}_{len(names)}.distcp")
            storage[index] = dataclasses.replace(info, relative_path=new)
        for old, new in names.items():
            os.replace(part / old, folder / new)
        if merged is None:
            merged = Metadata(
                state_dict_metadata=dict(metadata.state_dict_metadata),
                planner_data=metadata.planner_data,
                storage_data={},
                storage_meta=metadata.storage_meta,
            )
        for fqn, item in metadata.state_dict_metadata.items():
            have = merged.state_dict_metadata.setdefault(fqn, item)
            if have is not item and isinstance(item, TensorStorageMetadata):
                if not isinstance(have, TensorStorageMetadata):
                    raise ValueError(f"{fqn}: a tensor on rank {r}, plain data on another rank")
                known = {tuple(chunk.offsets) for chunk in have.chunks}
                have.chunks.extend(c for c in item.chunks if tuple(c.offsets) not in known)
        for index, info in storage.items():
            merged.storage_data.setdefault(index, info)
    if merged is None:
        raise ValueError("no parts to merge")
    return merged


def load_into(folder: Path, state: dict[str, Any], *, group: Any = None) -> None:
    """Collective: read the DCP directory ``folder`` into ``state`` in place (resharded).

    Raises:
        CheckpointError: the checkpoint does not load (the message names it and says why).
    """
    try:
        dcp.load(
            state, storage_reader=SafeReader(folder), planner=SafeLoadPlanner(), process_group=group
        )
    except (Exception, CheckpointException) as exc:  # DCP's error is a BaseException
        raise ckpt.CheckpointError(
            f"sharded checkpoint {folder} does not load: {_reason(exc)}"
        ) from exc


def _reason(exc: BaseException) -> str:
    """One line out of DCP's ``CheckpointException`` (which lists every rank's traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, error = next(iter(sorted(failures.items(), key=lambda item: item[0])))
        inner = error[0] if isinstance(error, tuple) else error
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(exc).__name__}: {exc}"


def read_full(folder: Path) -> dict[str, Any]:
    """The whole state of the DCP directory ``folder`` as plain tensors and data, in this process
    (no process group; as much memory as the checkpoint).

    Raises:
        CheckpointError: it does not load (unsafe content included).
    """
    state: dict[str, Any] = {}
    try:
        torch_compat.dcp_load_whole(
            state, storage_reader=SafeReader(folder), planner=SafeEmptyLoadPlanner()
        )
    except (Exception, CheckpointException) as exc:  # DCP's error is a BaseException
        raise ckpt.CheckpointError(
            f"sharded checkpoint {folder} does not load: {_reason(exc)}"
        ) from exc
    return state


def describe(folder: Path) -> dict[str, dict[str, int]]:
    """Tensors and bytes per top-level entry (``model``, ``optimizer``, ...) from the metadata
    alone, without reading a shard.

    Raises:
        CheckpointError: the metadata is missing or unsafe.
    """
    try:
        metadata = read_metadata(folder)
    except (OSError, pickle.UnpicklingError) as exc:
        raise ckpt.CheckpointError(
            f"sharded checkpoint {folder}: metadata unreadable ({exc})"
        ) from exc
    entries: dict[str, dict[str, int]] = {}
    planner_data = metadata.planner_data or {}
    for fqn, item in metadata.state_dict_metadata.items():
        path = planner_data.get(fqn) or (fqn.split(".", 1)[0],)
        entry = entries.setdefault(str(path[0]), {"tensors": 0, "bytes": 0, "elements": 0})
        if not isinstance(item, TensorStorageMetadata):  # plain data, saved as bytes
            continue
        numel = 1
        for dim in item.size:
            numel *= int(dim)
        entry["tensors"] += 1
        entry["elements"] += numel
        entry["bytes"] += numel * torch.empty((), dtype=item.properties.dtype).element_size()
    return entries


def export(info: ckpt.CheckpointInfo, out: Path) -> dict[str, Any]:
    """Write ``info``'s checkpoint (either format) to ``out`` as one plain ``torch.save`` file that
    ``torch.load(out, weights_only=True)`` opens, the same layout as a single-file checkpoint
    (``["model"]`` is a full, unsharded state dict). Atomic: ``out`` appears complete or not at all.

    Raises:
        CheckpointError: the checkpoint does not load.
        OSError: ``out`` cannot be written.
    """
    started = time.monotonic()
    if info.manifest.sharded:
        state = read_full(info.path)
    else:
        state = ckpt.load_checkpoint(info.path, torch.device("cpu"))
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out, durable=True) as file:
        torch.save(state, file)
    return {
        "source": str(info.path),
        "out": str(out),
        "step": info.step,
        "bytes": out.stat().st_size,
        "seconds": round(time.monotonic() - started, 3),
    }
