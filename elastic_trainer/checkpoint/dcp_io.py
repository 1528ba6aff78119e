"""torch.distributed.checkpoint (DCP) plumbing for sharded checkpoints: reading that never
unpickles code, and host staging in reused buffers.

- :class:`SafeReader` reads DCP's ``.metadata`` (a pickle) through a restricted unpickler that
  admits only DCP's metadata classes and torch dtypes (``torch_compat.DCP_METADATA_CLASSES``); DCP's
  own reader calls ``pickle.load``.
- :class:`SafeLoadPlanner` and :data:`SafeEmptyLoadPlanner` load the non-tensor entries (step,
  optimizer hyper-parameters, sampler cursor) with ``torch.load(weights_only=True)``; DCP's default
  planners unpickle them unrestricted. Tensor data DCP reads with ``weights_only=True`` itself.
- :class:`HostStager` copies a state dict (DTensors included: each rank copies only its local
  shard) into host buffers it keeps from save to save, pinned only where CUDA exists; a new layout
  (another world size, a new optimizer state) allocates new ones.

Invariant: nothing here unpickles a checkpoint unrestricted (no ``pickle.load``; every
``torch.load`` is ``weights_only=True``). Design:
``docs/design/sharded.md``.
"""

from __future__ import annotations

import io
import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from elastic_trainer.runtime import torch_compat

METADATA_FILE = ".metadata"
"""The file DCP's ``FileSystemWriter`` writes its pickled :class:`Metadata` to (torch 2.13)."""

GROUP_TIMEOUT_S = 300.0
"""Collectives of a checkpoint's own process group give up after this long (a peer died mid-save)
instead of gloo's 30 minutes; the save then fails and earlier checkpoints stand."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and torch dtypes; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in torch_compat.DCP_METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


def read_metadata(folder: Path) -> Metadata:
    """The DCP metadata of the checkpoint directory ``folder``, read without running code.

    Raises:
        OSError: the file cannot be read.
        pickle.UnpicklingError: it names a class outside the allowlist, or is not a pickle.
    """
    with open(folder / METADATA_FILE, "rb") as file:
        try:
            metadata = _MetadataUnpickler(file).load()
        except (EOFError, ValueError, TypeError, AttributeError) as exc:
            raise pickle.UnpicklingError(f"unreadable: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` in place of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """See base class."""
        metadata = read_metadata(Path(self.path))
        storage_meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _WeightsOnlyBytes:
    """``load_bytes`` of DCP's default planner, with ``weights_only=True``."""

    flatten_state_dict: bool
    original_state_dict: Any
    mappings: Any
    state_dict: Any

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """See base class."""
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            torch_compat.dcp_set_element(
                self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj
            )
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """Loads into a given state dict (DCP reshards onto its DTensors' current placement)."""


SafeEmptyLoadPlanner: type = type(
    "SafeEmptyLoadPlanner",
    (_WeightsOnlyBytes, torch_compat.dcp_empty_state_dict_planner()),
    {"__doc__": "Rebuilds the whole state dict from the metadata (export)."},
)


def save_in_this_process(
    state: dict[str, Any], *, storage_writer: Any, planner: Any = None
) -> None:
    """``dcp.save(..., no_dist=True)``: this process writes the shards it holds with no collective
    (a just-in-time save after the group failed), without DCP's warning that it assumes a single
    process (on purpose here; a survivor's log would show it once per save)."""
    torch_compat.dcp_save_in_this_process(state, storage_writer=storage_writer, planner=planner)


def checkpoint_group() -> Any:
    """Collective: a gloo process group of all ranks for the checkpoint's own collectives (DCP's
    planning and commit), so that a save on a background thread never interleaves with the
    training collectives of the default group (and runs on the CPU next to NCCL training)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))


def _layout(obj: Any) -> Any:
    """What the staging buffers depend on: structure, and each tensor's local shape and dtype."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return (tuple(local.shape), local.dtype, type(obj).__name__)
    if isinstance(obj, dict):
        return tuple((key, _layout(value)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(_layout(value) for value in obj)
    return type(obj).__name__


class HostStager:
    """Copies of successive state dicts in the same host buffers (see the module docstring).

    A staged state is read by one write at a time: the next :meth:`stage` overwrites it, so the
    caller waits for the previous write first (the sharded writer does).
    """

    def __init__(self) -> None:
        self._pin = torch.cuda.is_available()
        self._buffers: dict[str, Any] | None = None
        self._layout: Any = None
        self.allocations = 0
        """Times a set of buffers was allocated (a reused layout allocates none)."""

    @property
    def pinned(self) -> bool:
        """Whether the buffers are pinned host memory (only where CUDA exists)."""
        return self._pin

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A host copy of ``state``, in the kept buffers (DTensors: the local shard only)."""
        layout = _layout(state)
        if self._buffers is None or layout != self._layout:
            self._buffers = torch_compat.dcp_host_state_dict(state, pin_memory=self._pin)
            self._layout = layout
            self.allocations += 1
        return torch_compat.dcp_copy_state_dict(state, self._buffers, non_blocking=False)
