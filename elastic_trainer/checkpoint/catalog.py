"""``elastic-trainer checkpoint list|verify|inspect DIR``: look at checkpoints without training.

Nothing here touches a GPU: ``inspect`` loads with ``map_location="cpu"``, ``mmap=True`` and
``weights_only=True``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from elastic_trainer.checkpoint.files import (
    CheckpointError,
    checkpoint_path,
    iter_checkpoints,
    verify,
)
from elastic_trainer.runtime.failures import UserError


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
        manifest_file = checkpoint_path(directory, step).with_suffix(".json")
        try:
            manifest = json.loads(manifest_file.read_text())
        except (OSError, ValueError):
            manifest = {}
        rows.append({
            "path": str(checkpoint_path(directory, step)),
            "step": step,
            "epoch": manifest.get("epoch"),
            "world_size": manifest.get("world_size"),
            "bytes": manifest.get("nbytes"),
        })
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
            results.append({"step": step, "path": str(checkpoint_path(directory, step)), "ok": False, "error": str(exc)})
    return results


def _tensor_summary(obj: Any) -> tuple[int, int]:
    """(tensor count, bytes) inside a nested structure."""
    if isinstance(obj, torch.Tensor):
        return 1, obj.numel() * obj.element_size()
    children: Any = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    count = size = 0
    for child in children:
        c, s = _tensor_summary(child)
        count, size = count + c, size + s
    return count, size


def inspect_checkpoint(target: str) -> dict[str, Any]:
    """What a checkpoint holds; ``target`` is a checkpoint file or a directory (its newest)."""
    path = Path(target)
    if path.is_dir():
        path = checkpoint_path(path, _steps_or_fail(path)[-1])
    elif not path.is_file():
        raise UserError(f"checkpoint {target}: no such file or directory")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # any unpickling/zip error means: not a loadable checkpoint
        raise UserError(f"checkpoint {path}: not a loadable checkpoint ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict) or "model" not in data:
        raise UserError(f"checkpoint {path}: not an elastic-trainer checkpoint (no 'model' entry)")
    entries = {}
    for key, value in data.items():
        count, size = _tensor_summary(value)
        entries[key] = {"tensors": count, "bytes": size}
    return {
        "path": str(path),
        "step": data.get("step"),
        "epoch": data.get("epoch"),
        "world_size": data.get("world_size"),
        "entries": entries,
        "model_parameters": sum(
            v.numel() for v in data["model"].values() if isinstance(v, torch.Tensor)
        ),
    }
