"""Checkpoint files: atomic writes, a sha256 manifest, claims, safe loading, the async writer.

    ckpt-000000000100.pt     torch.save of a plain dict; torch.load(path, weights_only=True)
                             gives {"model": <state_dict>, "optimizer": ..., "step": 100, ...}
    ckpt-000000000100.json   manifest: sha256 and size of the .pt, step, epoch, world size and
                             the job fingerprint
    ckpt-000000000100.dcp/   or, for sharded (FSDP) state, a torch.distributed.checkpoint directory
                             (every rank's shards and DCP's .metadata); its manifest lists the
                             sha256 and size of every file in it (:mod:`.sharded`)

Invariants: a crash or a full disk at any point leaves the complete new checkpoint or none, and
never touches earlier ones; a checkpoint counts only when its manifest exists and the ``.pt``
matches its sha256 (every file of a ``.dcp`` directory its own); loading is ``weights_only=True`` with no unsafe fallback; two processes never
write the same step (``O_CREAT | O_EXCL`` claims). File work only: the
:class:`~elastic_trainer.checkpoint.manager.CheckpointManager` decides who writes when. Design:
``docs/design/checkpointing.md``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_trainer.runtime.atomic_files import atomic_file, fsync_directory
from elastic_trainer.runtime.failures import DeterministicError

log = logging.getLogger(__name__)

FORMAT = "elastic-trainer/1"
_NAME_RE = re.compile(r"^ckpt-(\d{12})\.(pt|json|dcp)$")
_TMP_RE = re.compile(r"^\.ckpt-\d{12}\.(pt|json|dcp)\.tmp-\d+$")
_COMPLETE = ({"pt", "json"}, {"dcp", "json"})
"""The file kinds of a complete checkpoint: a single file or a sharded directory, and a manifest."""
_CLAIM_RE = re.compile(r"^\.ckpt-\d{12}\.claim$")
_CHUNK = 8 << 20


class CheckpointError(DeterministicError):
    """A checkpoint could not be used or written; the message says which file and why."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint directory belongs to another job (other model, dataset or seed)."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed; the previous checkpoints are untouched."""


class CheckpointFencedError(CheckpointError):
    """A checkpoint was written but not committed: its writer could not confirm that it still
    belongs to the job (see ``fence`` of :func:`save_checkpoint`). Nothing on disk changed."""


CommitFence = Callable[[], str | None]
"""Asked right before a checkpoint is committed: ``None`` to commit, or why not (one line)."""


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Path of the ``.pt`` file of ``step``."""
    return Path(directory) / f"ckpt-{step:012d}.pt"


def sharded_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Path of the ``.dcp`` directory of ``step`` (a sharded checkpoint)."""
    return Path(directory) / f"ckpt-{step:012d}.dcp"


def data_path(directory: str | os.PathLike[str], step: int) -> Path:
    """The data of ``step``'s checkpoint as found on disk: its ``.dcp`` directory if there is one,
    else its ``.pt`` file (which may not exist)."""
    sharded = sharded_path(directory, step)
    return sharded if sharded.is_dir() else checkpoint_path(directory, step)


def manifest_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Path of the manifest of ``step``."""
    return Path(directory) / f"ckpt-{step:012d}.json"


@dataclass(frozen=True, slots=True)
class Manifest:
    """What the ``.json`` next to each checkpoint records."""

    format: str
    file: str
    step: int
    epoch: int
    world_size: int
    sha256: str
    nbytes: int
    fingerprint: str
    fingerprint_fields: dict[str, Any]
    created_unix: float
    jit: bool = False
    """Written just in time by a surviving rank after a failure (absent in older manifests)."""
    files: dict[str, list[Any]] | None = None
    """Sharded checkpoints: ``{name: [sha256, nbytes]}`` of every file of the ``.dcp`` directory
    (``sha256``/``nbytes`` then cover this listing and the total); ``None`` for a single file."""

    @property
    def sharded(self) -> bool:
        return self.files is not None

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not an {FORMAT} manifest")
        # Fields with defaults may be missing (manifests written before they existed); a missing
        # required field is a TypeError, reported as a corrupt manifest by verify().
        return cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A complete, verified checkpoint on disk."""

    path: Path
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


# -- fingerprints ----------------------------------------------------------------------------------
def model_signature(state_dict: Mapping[str, Any]) -> list[list[Any]]:
    """``[name, shape, dtype]`` of every tensor of a state_dict: the model's identity."""
    return [
        [name, list(value.shape), str(value.dtype).removeprefix("torch.")]
        for name, value in state_dict.items()
        if isinstance(value, torch.Tensor)
    ]


def job_fingerprint(fields: Mapping[str, Any]) -> str:
    """sha256 of the JSON of ``fields`` (keys sorted): equal jobs, equal fingerprints."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def check_fingerprint(info: CheckpointInfo, expected: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointMismatchError` unless ``info`` was written by the same job.

    The message names the first field that differs (for the model: the first tensor).
    """
    if info.manifest.fingerprint == job_fingerprint(expected):
        return
    saved = info.manifest.fingerprint_fields
    for key in sorted(set(saved) | set(expected)):
        if saved.get(key) == expected.get(key):
            continue
        if key == "model":
            detail = _first_model_difference(saved.get(key) or [], expected.get(key) or [])
        else:
            detail = f"{key} is {expected.get(key)!r} here but {saved.get(key)!r} in the checkpoint"
        break
    else:
        detail = "fingerprint differs"
    raise CheckpointMismatchError(
        f"checkpoint {info.path} belongs to a different job ({detail}); use another checkpoint "
        "directory (--checkpoint-dir / checkpoint_dir=) or remove it. Nothing was overwritten."
    )


def _first_model_difference(saved: list[list[Any]], here: list[list[Any]]) -> str:
    def describe(shape: list[int], dtype: str) -> str:
        return f"{dtype}{list(shape)}"

    saved_by_name = {entry[0]: describe(*entry[1:]) for entry in saved}
    here_by_name = {entry[0]: describe(*entry[1:]) for entry in here}
    for name, spec in here_by_name.items():
        if name not in saved_by_name:
            return f"model tensor {name!r} is not in the checkpoint"
        if saved_by_name[name] != spec:
            return (
                f"model tensor {name!r} is {spec} here but {saved_by_name[name]} in the checkpoint"
            )
    for name in saved_by_name:
        if name not in here_by_name:
            return f"the checkpoint has model tensor {name!r} that this model lacks"
    return "model differs"


# -- atomic writes ---------------------------------------------------------------------------------
class _HashingWriter:
    """File wrapper that hashes and counts what passes through (torch.save streams into it)."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.sha256 = hashlib.sha256()
        self.nbytes = 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.nbytes += len(data)
        try:
            return self._file.write(data)
        except OSError as exc:
            # torch.save turns this into a RuntimeError; keep it so the caller can report errno.
            self.error = exc
            raise

    def flush(self) -> None:
        self._file.flush()


def _write_atomically(
    target: Path, write: Callable[[Any], None], before_replace: Callable[[], None] | None = None
) -> _HashingWriter:
    """Write ``target`` through an fsynced temporary file (:func:`atomic_file`), hashing what
    passes; a write error keeps its errno (``torch.save`` would wrap it in a RuntimeError)."""
    writer: _HashingWriter | None = None
    try:
        with atomic_file(target, durable=True, before_replace=before_replace) as file:
            writer = _HashingWriter(file)
            write(writer)
    except BaseException as exc:
        if writer is not None and writer.error is not None and exc is not writer.error:
            raise writer.error from exc
        raise
    return writer


def save_checkpoint(
    directory: str | os.PathLike[str],
    payload: Mapping[str, Any],
    *,
    step: int,
    epoch: int,
    world_size: int,
    fingerprint_fields: Mapping[str, Any],
    keep_last: int | None,
    jit: bool = False,
    fence: CommitFence | None = None,
) -> CheckpointInfo:
    """Write ``payload`` as the checkpoint of ``step``, then prune all but the ``keep_last`` newest.

    ``keep_last=None`` prunes nothing (just-in-time writers leave pruning to rank 0, so that two
    writers never delete each other's files); ``jit`` is recorded in the manifest. ``fence`` is
    asked once the data is durable in its temporary file, right before anything is renamed into
    place: a writer cut off from its job (a partition) leaves the directory as it was.

    Raises:
        CheckpointFencedError: ``fence`` refused; nothing on disk changed.
        CheckpointWriteError: the write failed (full disk, permissions, ...). Earlier checkpoints
            are untouched and nothing was pruned.
    """
    directory = Path(directory)
    pt = checkpoint_path(directory, step)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        writer = _write_atomically(
            pt,
            lambda file: torch.save(dict(payload), file),
            before_replace=lambda: ask_fence(fence, step),
        )
        manifest = new_manifest(
            pt.name,
            step=step,
            epoch=epoch,
            world_size=world_size,
            sha256=writer.sha256.hexdigest(),
            nbytes=writer.nbytes,
            fingerprint_fields=fingerprint_fields,
            jit=jit,
        )
        write_manifest(directory, manifest)
    except CheckpointFencedError:
        raise
    except Exception as exc:
        # A half-renamed pair (.pt without manifest) is ignored by readers and pruned as leftovers.
        raise write_error(directory, step, exc) from exc
    if keep_last is not None:
        prune(directory, keep_last)
    log.info(
        "%scheckpoint of step %d written to %s (%.1f MB)",
        "just-in-time " if jit else "",
        step,
        pt,
        manifest.nbytes / 1e6,
    )
    return CheckpointInfo(path=pt, manifest=manifest)


def ask_fence(fence: CommitFence | None, step: int) -> None:
    """Ask ``fence`` (if any) right before the checkpoint of ``step`` is committed.

    Raises:
        CheckpointFencedError: it refused.
    """
    refused = fence() if fence is not None else None
    if refused is not None:
        raise CheckpointFencedError(f"the checkpoint of step {step} was not committed: {refused}")


def new_manifest(
    file: str,
    *,
    step: int,
    epoch: int,
    world_size: int,
    sha256: str,
    nbytes: int,
    fingerprint_fields: Mapping[str, Any],
    jit: bool = False,
    files: dict[str, list[Any]] | None = None,
) -> Manifest:
    """The manifest of a checkpoint whose data (``file``, in the same directory) is durable."""
    fields = dict(fingerprint_fields)
    return Manifest(
        format=FORMAT,
        file=file,
        step=step,
        epoch=epoch,
        world_size=world_size,
        sha256=sha256,
        nbytes=nbytes,
        fingerprint=job_fingerprint(fields),
        fingerprint_fields=fields,
        created_unix=time.time(),
        jit=jit,
        files=files,
    )


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Commit a checkpoint: write its manifest atomically and make it durable (the data first)."""
    text = json.dumps(asdict(manifest), indent=1, sort_keys=True).encode()
    _write_atomically(manifest_path(directory, manifest.step), lambda f: f.write(text))
    fsync_directory(directory)


def one_line_reason(exc: BaseException) -> str:
    """``exc`` in one line: its type and the first line of its message; a DCP
    ``CheckpointException`` (whose text holds every failed rank's traceback) as each failed
    rank's error."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"rank {rank}: {one_line_reason(pair[0] if isinstance(pair, tuple) else pair)}"
            for rank, pair in sorted(failures.items())
        )
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def write_error(directory: Path, step: int, exc: BaseException) -> CheckpointWriteError:
    """The one-line error for a failed write of ``step`` (errno kept, earlier checkpoints named)."""
    if isinstance(exc, OSError):
        reason = (
            "the disk is full"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT)
            else (exc.strerror or str(exc))
        )
        reason = f"{reason} (errno {exc.errno})"
    else:
        reason = one_line_reason(exc)
    previous = latest_name(directory, before=step)
    kept = (
        f"the previous checkpoint {previous} is untouched"
        if previous
        else "no earlier checkpoint exists"
    )
    return CheckpointWriteError(
        f"could not write the checkpoint of step {step} to {directory}: {reason}; {kept}"
    )


def _steps(directory: Path) -> dict[int, set[str]]:
    found: dict[int, set[str]] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            match = _NAME_RE.match(entry.name)
            if match:
                found.setdefault(int(match.group(1)), set()).add(match.group(2))
    return found


def latest_name(directory: Path, *, before: int | None = None) -> str | None:
    """Name of the newest complete-looking checkpoint (``.pt`` and manifest), unverified."""
    complete = [s for s, kinds in _steps(directory).items() if kinds in _COMPLETE]
    if before is not None:
        complete = [s for s in complete if s < before]
    return data_path(directory, max(complete)).name if complete else None


def prune(directory: Path, keep_last: int) -> None:
    """Delete all but the ``keep_last`` newest complete checkpoints (manifest first, then the
    .pt), and incomplete leftovers older than the oldest one kept."""
    found = _steps(directory)
    complete = sorted((s for s, kinds in found.items() if kinds in _COMPLETE), reverse=True)
    if not complete:
        return
    kept = complete[:keep_last]
    for step in found:
        if step < kept[-1] or (
            step not in kept and step < kept[0] and found[step] not in _COMPLETE
        ):
            for path in (
                manifest_path(directory, step),
                checkpoint_path(directory, step),
                sharded_path(directory, step),
            ):
                _remove(path)


def _remove(path: Path) -> None:
    """Delete a file or a sharded checkpoint's directory; gone already is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_stale_temp_files(directory: str | os.PathLike[str]) -> None:
    """Delete temp files (and sharded temp directories) left by writers killed mid-write."""
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if _TMP_RE.match(entry.name):
                _remove(Path(entry.path))


# -- one writer per step ---------------------------------------------------------------------------
def claim_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Path of the claim file a writer of ``step`` holds while it writes."""
    return Path(directory) / f".ckpt-{step:012d}.claim"


@dataclass(frozen=True, slots=True)
class StepClaim:
    """The right to write one step's checkpoint, held by this process until :meth:`release`."""

    path: Path
    step: int

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def claim_owner() -> dict[str, Any]:
    """What a claim file records about its holder."""
    return {"host": os.uname().nodename, "pid": os.getpid(), "created_unix": time.time()}


def try_claim(directory: str | os.PathLike[str], step: int, **details: Any) -> StepClaim | None:
    """Create the claim of ``step`` atomically (``O_CREAT | O_EXCL``); ``None`` if someone holds it.

    ``details`` (plain data, e.g. the rank) are recorded beside host and pid for people reading
    the directory.

    Raises:
        OSError: the directory cannot be written (other than the claim existing).
    """
    path = claim_path(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    try:
        os.write(fd, json.dumps({**claim_owner(), **details}, sort_keys=True).encode())
    finally:
        os.close(fd)
    return StepClaim(path=path, step=step)


def read_claim(directory: str | os.PathLike[str], step: int) -> dict[str, Any] | None:
    """The holder of ``step``'s claim as recorded in the file, or ``None`` (no claim, or unreadable:
    the holder may be between creating and writing it)."""
    try:
        data = json.loads(claim_path(directory, step).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def held_by_this_process(holder: Mapping[str, Any] | None) -> bool:
    return (
        holder is not None
        and holder.get("pid") == os.getpid()
        and holder.get("host") == os.uname().nodename
    )


def remove_stale_claims(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete every claim file (rank 0 at start-up: writers of the previous group are gone)."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if _CLAIM_RE.match(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    if removed:
        log.info(
            "removed claims left by interrupted checkpoint writers: %s",
            ", ".join(p.name for p in removed),
        )
    return removed


def newest_step(directory: str | os.PathLike[str]) -> int | None:
    """Step of the newest checkpoint that has both files (unverified), ``None`` if there is none."""
    steps = iter_checkpoints(directory)
    return max(steps) if steps else None


# -- finding and loading ---------------------------------------------------------------------------
def sha256_of(path: Path) -> tuple[str, int]:
    """The sha256 (hex) and size of the file at ``path``, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def verify(directory: Path, step: int) -> CheckpointInfo:
    """Check the checkpoint of ``step`` against its manifest.

    Raises:
        CheckpointError: manifest missing or unreadable, file missing, size or sha256 mismatch.
    """
    pt, js = data_path(directory, step), manifest_path(directory, step)
    try:
        manifest = Manifest.from_json(js.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {pt} has no manifest {js.name} (its write was interrupted, or it was not "
            "written by a checkpoint manager: `checkpoint export` output is for loading elsewhere, "
            "not for resuming)"
        ) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"checkpoint manifest {js} is corrupt ({exc})") from exc
    if manifest.step != step or manifest.file != pt.name:
        raise CheckpointError(f"checkpoint manifest {js} describes {manifest.file}, not {pt.name}")
    if manifest.sharded:
        verify_files(pt, manifest.files or {})
        return CheckpointInfo(path=pt, manifest=manifest)
    try:
        digest, size = sha256_of(pt)
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {pt} is missing (its manifest {js.name} exists)"
        ) from None
    if size != manifest.nbytes:
        raise CheckpointError(
            f"checkpoint {pt} is truncated or corrupt: {size} bytes, manifest says {manifest.nbytes}"
        )
    if digest != manifest.sha256:
        raise CheckpointError(
            f"checkpoint {pt} is corrupt: sha256 {digest[:16]}... does not match its manifest"
        )
    return CheckpointInfo(path=pt, manifest=manifest)


def verify_files(folder: Path, files: Mapping[str, list[Any]]) -> None:
    """Check every file of a sharded checkpoint's directory against ``files`` (its manifest's
    ``{name: [sha256, nbytes]}``); a file the listing lacks is damage too.

    Raises:
        CheckpointError: a file is missing, extra, truncated or corrupt (the message names it).
    """
    try:
        present = {entry.name for entry in os.scandir(folder) if entry.is_file()}
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} is missing (its manifest exists)") from None
    for extra in sorted(present - set(files)):
        raise CheckpointError(
            f"checkpoint {folder} holds {extra}, which its manifest does not list"
        )
    for name, (sha256, nbytes) in sorted(files.items()):
        path = folder / name
        try:
            digest, size = sha256_of(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint {folder} lacks {name} (its manifest lists it)"
            ) from None
        if size != nbytes:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or corrupt: {size} bytes, manifest says {nbytes}"
            )
        if digest != sha256:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt: sha256 {digest[:16]}... does not match its manifest"
            )


def find_latest(directory: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The newest checkpoint that verifies, or ``None``.

    Every newer checkpoint that fails verification is logged as a warning naming the file.
    """
    directory = Path(directory)
    for step in sorted(_steps(directory), reverse=True):
        try:
            return verify(directory, step)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s; falling back to the previous one", exc)
    return None


def choose_resume(
    directory: str | os.PathLike[str], fingerprint_fields: Mapping[str, Any]
) -> tuple[str, str | None]:
    """(Rank 0, at start-up) which checkpoint every rank loads, as ``(kind, value)`` to broadcast:
    ``("load", path)``, ``("none", None)``, ``("mismatch", message)`` (another job's directory:
    nothing touched) or ``("error", message)``. Clears what dead writers left (temporary files,
    claims) and sets aside the damaged checkpoints newer than the one chosen."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        return ("error", f"checkpoint_dir {directory} exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"{directory} is not writable")
        remove_stale_temp_files(directory)
        remove_stale_claims(directory)  # writers of the previous group are gone by now
        info = find_latest(directory)
    except OSError as exc:
        return ("error", f"checkpoint_dir {directory} cannot be used: {exc.strerror or exc}")
    if info is not None:
        try:
            check_fingerprint(info, fingerprint_fields)
        except CheckpointMismatchError as exc:
            return ("mismatch", str(exc))  # another job's directory: touch nothing
    # With the job's own checkpoint chosen (or none usable), set the newer damaged ones aside.
    quarantine_newer_than(directory, None if info is None else info.step)
    return ("none", None) if info is None else ("load", str(info.path))


def chosen_path(choice: tuple[str, str | None] | None) -> str | None:
    """The path to load from a :func:`choose_resume` result as every rank received it
    (``None``: start from scratch).

    Raises:
        CheckpointMismatchError: rank 0 found another job's checkpoint.
        CheckpointError: rank 0 could not use the directory.
    """
    kind, value = choice or ("none", None)
    if kind == "mismatch":
        raise CheckpointMismatchError(value)
    if kind == "error":
        raise CheckpointError(value)
    if kind == "load" and value is None:
        raise RuntimeError("rank 0 chose to load a checkpoint but sent no path")
    return value if kind == "load" else None


def quarantine_newer_than(directory: str | os.PathLike[str], step: int | None) -> list[Path]:
    """Rename every checkpoint file newer than ``step`` (all if ``None``) to ``*.corrupt``.

    Called by rank 0 once it resumes from ``step``: the newer files failed verification, and
    leaving them under their names would let pruning delete good checkpoints in their favour.
    """
    directory = Path(directory)
    moved = []
    for newer in sorted(_steps(directory)):
        if step is not None and newer <= step:
            continue
        for path in (
            checkpoint_path(directory, newer),
            sharded_path(directory, newer),
            manifest_path(directory, newer),
        ):
            corrupt = path.with_name(path.name + ".corrupt")
            _remove(
                corrupt
            )  # an earlier quarantine of the same step (os.replace cannot replace a directory)
            with contextlib.suppress(FileNotFoundError):
                os.replace(path, corrupt)
                moved.append(path)
    if moved:
        log.warning(
            "set aside damaged checkpoint files as *.corrupt: %s", ", ".join(p.name for p in moved)
        )
    return moved


def map_location_for(device: torch.device) -> Callable[[Any, str], Any]:
    """A ``map_location`` putting tensors saved on any CUDA device onto ``device``.

    ``cuda:N`` becomes ``device`` when it is a CUDA device (so rank 3 never loads onto GPU 0) and
    CPU otherwise; CPU tensors stay on the CPU (RNG states must).
    """
    target = str(device)

    def _map(storage: Any, location: str) -> Any:
        if location.startswith("cuda"):
            return torch.serialization.default_restore_location(
                storage, target if device.type == "cuda" else "cpu"
            )
        return storage

    return _map


def load_checkpoint(path: str | os.PathLike[str], device: torch.device) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` with the device mapping of :func:`map_location_for`.

    Raises:
        CheckpointError: the file does not load as a plain-data checkpoint of this format.
    """
    try:
        state = torch.load(path, map_location=map_location_for(device), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - translated at the boundary, never retried unsafely
        raise CheckpointError(
            f"checkpoint {path} does not load with weights_only=True: {exc}"
        ) from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT or "model" not in state:
        raise CheckpointError(f"{path} is not an {FORMAT} checkpoint")
    return state


# -- async writing -----------------------------------------------------------------------------------
class AsyncCheckpointWriter:
    """Writes checkpoints on a background thread, at most one in flight.

    :meth:`submit` first waits for the previous write (so a slow disk slows training down instead
    of piling up snapshots in memory) and re-raises its error, if any.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: CheckpointInfo | None = None
        self.on_written: Callable[[CheckpointInfo, float], None] | None = None
        self.on_refused: Callable[[CheckpointFencedError], None] | None = None
        """Called (on the writer's thread) when the commit fence refused the write."""

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """The last write ended with an error (:meth:`wait` raises it). Never waits."""
        return self._error is not None and not self.busy

    def submit(self, save: Callable[[], CheckpointInfo | None]) -> None:
        """Run ``save`` (usually :func:`save_checkpoint` over a CPU snapshot) in the background;
        ``None``: a part written, the checkpoint committed elsewhere (a sharded save's rank > 0)."""
        self.wait()
        self._thread = threading.Thread(
            target=self._run, args=(save,), name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def _run(self, save: Callable[[], CheckpointInfo | None]) -> None:
        started = time.monotonic()
        try:
            self._result = save()
            if self.on_written is not None and self._result is not None:
                self.on_written(self._result, time.monotonic() - started)
        except CheckpointFencedError as exc:  # not a failure: the next checkpoint tries again
            log.warning("%s", exc)
            if self.on_refused is not None:
                self.on_refused(exc)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = exc

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the write in flight; re-raise its error. Returns the last checkpoint written.

        Raises:
            CheckpointError: the background write failed, or did not finish within ``timeout``.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise CheckpointError(
                    f"the background checkpoint write did not finish within {timeout:.0f} s"
                )
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointWriteError(
                f"the background checkpoint write failed: {error}"
            ) from error
        return self._result


def iter_checkpoints(directory: str | os.PathLike[str]) -> list[int]:
    """Steps that have a ``.pt`` (or ``.dcp``) and a manifest, oldest first (unverified)."""
    return sorted(s for s, kinds in _steps(Path(directory)).items() if kinds in _COMPLETE)
