"""``elastic-trainer checkpoint list|verify|inspect DIR`` and ``export DIR OUT.pt``: look at
checkpoints without training, in both formats (single ``.pt`` files and sharded ``.dcp``
directories).

Nothing here touches a GPU or a process group: ``inspect`` loads a ``.pt`` with
``map_location="cpu"``, ``mmap=True`` and ``weights_only=True``, and reads a sharded checkpoint's
metadata only; ``export`` gathers a sharded checkpoint in this process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from elastic_trainer.checkpoint import sharded
from elastic_trainer.checkpoint.files import (
    CheckpointError,
    CheckpointInfo,
    data_path,
    find_latest,
    iter_checkpoints,
    manifest_path,
    verify,
)
from elastic_trainer.runtime.failures import UserError

_STEP_RE = re.compile(r"^ckpt-(\d{12})\.(pt|dcp)$")


def _directory(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise UserError(f"checkpoint directory {text}: no such directory")
    if not path.is_dir():
        raise UserError(f"checkpoint directory {text}: not a directory")
    return path


def _steps_or_fail(directory: Path) -> list[int]:
    steps = list(iter_checkpoints(directory))
    if not steps:
        raise UserError(f"checkpoint directory {directory}: holds no elastic-trainer checkpoints")
    return steps


def list_checkpoints(directory_text: str) -> list[dict[str, Any]]:
    """Checkpoints with path, step and manifest facts, newest last (unverified)."""
    directory = _directory(directory_text)
    rows = []
    for step in iter_checkpoints(directory):
        try:
            manifest = json.loads(manifest_path(directory, step).read_text())
        except (OSError, ValueError):
            manifest = {}
        rows.append(
            {
                "path": str(data_path(directory, step)),
                "step": step,
                "epoch": manifest.get("epoch"),
                "world_size": manifest.get("world_size"),
                "bytes": manifest.get("nbytes"),
                "format": "sharded" if manifest.get("files") is not None else "single",
            }
        )
    return rows


def verify_checkpoints(directory_text: str) -> list[dict[str, Any]]:
    """Every checkpoint checked against its manifest's sha256 and size."""
    directory = _directory(directory_text)
    results = []
    for step in _steps_or_fail(directory):
        try:
            info = verify(directory, step)
            results.append({"step": step, "path": str(info.path), "ok": True, "error": None})
        except CheckpointError as exc:
            results.append(
                {
                    "step": step,
                    "path": str(data_path(directory, step)),
                    "ok": False,
                    "error": str(exc),
                }
            )
    return results


def _tensor_summary(obj: Any) -> tuple[int, int]:
    """(tensor count, bytes) inside a nested structure."""
    if isinstance(obj, torch.Tensor):
        return 1, obj.numel() * obj.element_size()
    children: Any = (
        obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    )
    count = size = 0
    for child in children:
        c, s = _tensor_summary(child)
        count, size = count + c, size + s
    return count, size


def _is_sharded(path: Path) -> bool:
    return path.is_dir() and (path.suffix == ".dcp" or (path / sharded.METADATA_FILE).is_file())


def inspect_checkpoint(target: str) -> dict[str, Any]:
    """What a checkpoint holds; ``target`` is a checkpoint (``.pt`` file or ``.dcp`` directory)
    or a checkpoint directory (its newest)."""
    path = Path(target)
    if path.is_dir() and not _is_sharded(path):
        path = data_path(path, _steps_or_fail(path)[-1])
    elif not path.exists():
        raise UserError(f"checkpoint {target}: no such file or directory")
    elif path.suffix == ".json":  # a manifest: what it describes
        described = [p for p in (path.with_suffix(".pt"), path.with_suffix(".dcp")) if p.exists()]
        if not described:
            raise UserError(f"checkpoint {path}: a manifest whose checkpoint is missing")
        path = described[0]
    if _is_sharded(path):
        return _inspect_sharded(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # any unpickling/zip error means: not a loadable checkpoint
        raise UserError(
            f"checkpoint {path}: not a loadable checkpoint ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(data, dict) or "model" not in data:
        raise UserError(f"checkpoint {path}: not an elastic-trainer checkpoint (no 'model' entry)")
    entries = {}
    for key, value in data.items():
        count, size = _tensor_summary(value)
        entries[key] = {"tensors": count, "bytes": size}
    return {
        "path": str(path),
        "format": "single",
        "step": data.get("step"),
        "epoch": data.get("epoch"),
        "world_size": data.get("world_size"),
        "entries": entries,
        "model_parameters": count_parameters(data["model"]),
    }


def _inspect_sharded(path: Path) -> dict[str, Any]:
    """A sharded checkpoint from its metadata and manifest, without reading a shard."""
    try:
        entries = sharded.describe(path)
    except CheckpointError as exc:
        raise UserError(str(exc)) from exc
    try:
        manifest = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        manifest = {}
    return {
        "path": str(path),
        "format": "sharded",
        "step": manifest.get("step"),
        "epoch": manifest.get("epoch"),
        "world_size": manifest.get("world_size"),
        "entries": {
            key: {"tensors": e["tensors"], "bytes": e["bytes"]} for key, e in entries.items()
        },
        "model_parameters": entries.get("model", {}).get("elements", 0),
    }


def _chosen(target: str) -> CheckpointInfo:
    """The verified checkpoint ``target`` names: a checkpoint directory's newest good one, or one
    checkpoint (``.pt`` file or ``.dcp`` directory) checked against its manifest."""
    path = Path(target)
    match = _STEP_RE.match(path.name)
    if match and path.exists():
        try:
            return verify(path.parent, int(match.group(1)))
        except CheckpointError as exc:
            raise UserError(str(exc)) from exc
    directory = _directory(target)
    _steps_or_fail(directory)
    info = find_latest(directory)
    if info is None:
        raise UserError(
            f"checkpoint directory {target}: no checkpoint verifies (see elastic-trainer checkpoint verify)"
        )
    return info


def export_checkpoint(target: str, out_text: str) -> dict[str, Any]:
    """Write the checkpoint ``target`` names (see :func:`_chosen`) to ``out_text`` as one plain
    file that ``torch.load(out, weights_only=True)`` opens; ``["model"]`` is a full state dict."""
    out = Path(out_text)
    if out.is_dir():
        raise UserError(
            f"export target {out_text}: is a directory (give a file name, e.g. model.pt)"
        )
    info = _chosen(target)
    try:
        return sharded.export(info, out)
    except CheckpointError as exc:
        raise UserError(str(exc)) from exc
    except OSError as exc:
        raise UserError(f"export target {out_text}: {exc.strerror or exc}") from exc


def count_parameters(model_state: dict[str, Any]) -> int:
    """Elements of a model state's tensors, each tensor once: tied weights (one tensor under two
    keys, e.g. an embedding and an output layer) share their storage in the checkpoint."""
    seen: set[tuple[Any, ...]] = set()
    total = 0
    for value in model_state.values():
        if not isinstance(value, torch.Tensor):
            continue
        key = (
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            value.stride(),
        )
        if key in seen:
            continue
        seen.add(key)
        total += value.numel()
    return total
