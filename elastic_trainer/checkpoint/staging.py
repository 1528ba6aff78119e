"""Host copies of a checkpoint's tensors in reused buffers, so an asynchronous save stalls the
training thread only for the copy (and on CUDA not even for that).

The first save allocates one host buffer per tensor (pinned memory on CUDA) and keeps them; later
saves copy into them (``copy_``; on CUDA with ``non_blocking=True`` on the training stream, after
the update that produced the state, with an event behind the copies). The background writer calls
:meth:`StagedState.ready` before it reads: it waits for that event, the training thread never does.
A staged state must be written before the next one is staged (the buffers are reused): the
checkpoint writer keeps at most one write in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StagedState:
    """A payload whose tensors live in the staging buffers."""

    payload: Any
    nbytes: int
    event: Any = None

    def ready(self) -> None:
        """(Writer thread) wait until the copies have landed."""
        if self.event is not None:
            self.event.synchronize()


class StagingBuffers:
    """Reused host buffers for the tensors of successive checkpoints (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda" and torch.cuda.is_available()
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.allocations = 0
        """Buffers allocated so far (a reused layout allocates none)."""
        self._seen: dict[
            tuple[Any, ...], torch.Tensor
        ] = {}  # one stage's tensors by storage (aliases)

    def stage(self, payload: Any) -> StagedState:
        """Copy every tensor of ``payload`` (nested dicts, lists, tuples) into its buffer. A tensor
        that appears under several keys (tied weights) is copied once and stays one tensor, as
        ``torch.save`` of the live state would keep it."""
        nbytes = [0]
        self._seen = {}
        copied = self._copy(payload, (), nbytes)
        self._seen = {}
        event = None
        if self._pin:
            event = torch.cuda.Event()
            event.record()
        return StagedState(payload=copied, nbytes=nbytes[0], event=event)

    def _copy(self, obj: Any, path: tuple[Any, ...], nbytes: list[int]) -> Any:
        if isinstance(obj, torch.Tensor):
            source = obj.detach()
            alias = (
                source.device,
                source.untyped_storage().data_ptr(),
                source.storage_offset(),
                source.shape,
                source.stride(),
                source.dtype,
            )
            if alias in self._seen:
                return self._seen[alias]
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = torch.empty(
                    source.shape,
                    dtype=source.dtype,
                    device="cpu",
                    pin_memory=self._pin and source.is_cuda,
                )
                self._buffers[path] = buffer
                self.allocations += 1
            buffer.copy_(source, non_blocking=source.is_cuda)
            nbytes[0] += buffer.numel() * buffer.element_size()
            self._seen[alias] = buffer
            return buffer
        if isinstance(obj, dict):
            return {key: self._copy(value, (*path, key), nbytes) for key, value in obj.items()}
        if isinstance(obj, list):
            return [self._copy(value, (*path, i), nbytes) for i, value in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._copy(value, (*path, i), nbytes) for i, value in enumerate(obj))
        return obj
