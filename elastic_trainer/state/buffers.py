"""Rank 0's module buffers, held by every rank (BatchNorm statistics and the like).

A just-in-time save or a heal may be made by any surviving rank; it must hold what rank 0 would
have saved. The buffers ride on each step's control allreduce (no extra collective). Design:
``docs/design/checkpointing.md``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from elastic_trainer.runtime import torch_compat

log = logging.getLogger(__name__)


def _persistent_buffer_slots(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """``(module, attribute, state_dict key)`` of every buffer that a state_dict holds."""
    keys = set(model.state_dict().keys())
    slots = []
    for module_name, module in model.named_modules():
        for attr, buffer in module.named_buffers(recurse=False):
            key = f"{module_name}.{attr}" if module_name else attr
            if buffer is not None and key in keys:
                slots.append((module, attr, key))
    return slots


_EXCHANGEABLE = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
"""Buffer dtypes that round-trip exactly through float64 (int64 up to 2**53: step counters)."""


_INT_HEADROOM = 2**50
"""A 64-bit integer buffer replaces DDP's broadcast only below this at the start (a counter moved
by one a forward would need 2**53 - 2**50 forwards to leave float64's exact range)."""


def replaces_buffer_broadcast(model: nn.Module) -> bool:
    """Whether rank 0's buffers riding on the control allreduce (``AuthoritativeBuffers(apply=True)``)
    can stand in for DDP's forward-time buffer broadcast: every buffer DDP would broadcast is one a
    state_dict holds (the others do not ride), with a dtype that rides exactly (64-bit integers:
    holding values well inside float64's exact range now), and there is one."""
    persistent = {id(module._buffers[attr]) for module, attr, _ in _persistent_buffer_slots(model)}
    buffers = [b for _, b in model.named_buffers()]

    def rides(b: torch.Tensor) -> bool:
        if id(b) not in persistent or b.dtype not in _EXCHANGEABLE:
            return False
        return b.dtype != torch.int64 or b.numel() == 0 or int(b.abs().max()) < _INT_HEADROOM

    return bool(buffers) and all(rides(b) for b in buffers)


class AuthoritativeBuffers:
    """Rank 0's module buffers after the last completed step, held by every rank.

    They ride on the step's control allreduce (one collective per step, as without JIT). After a
    step's last forward (the backward does not change buffers), :meth:`capture` copies this
    rank's buffers as float64 and returns the contribution to append to the control tensor: rank
    0's values, ``-0.0`` from every other rank (``x + -0.0 == x`` bit for bit in IEEE
    arithmetic, ``+0.0`` and ``-0.0`` included, so the sum is rank 0's values exactly). Once that
    allreduce has completed, the update section calls :meth:`commit` with its result; a saver
    holding the guard calls :meth:`snapshot` and gets the buffers of exactly the step the
    weights are at.

    With ``apply=True`` :meth:`commit` also writes rank 0's values into this rank's module
    buffers: what DDP's forward-time buffer broadcast would do at the next forward, which the
    runtime then turns off (:func:`replaces_buffer_broadcast`). One collective per step fewer,
    and the buffers travel on a collective that an abort can end (``runtime/abortable.py``).
    """

    def __init__(
        self, model: nn.Module, *, rank: int, world_size: int, apply: bool = False
    ) -> None:
        self._slots = _persistent_buffer_slots(model)
        self._rank = rank
        self._world_size = world_size
        self._apply = (
            apply and rank != 0 and world_size > 1
        )  # rank 0's own values come back unchanged
        self._applied_views: dict[
            int, list[torch.Tensor]
        ] = {}  # reduced tensor's data_ptr -> its views
        self._layout: list[tuple[str, torch.dtype, torch.Size, int]] = []
        self._own: torch.Tensor | None = (
            None  # this rank's buffers of the step in progress, float64
        )
        self._views: list[torch.Tensor] = []  # _own cut into the buffers' shapes
        self._live: list[torch.Tensor] = []  # the buffer tensors _views were laid out for
        self._negative_zeros = torch.empty(0, dtype=torch.float64)
        self._own_committed: torch.Tensor | None = None  # where _commit_own keeps _own (reused)
        self._committed: torch.Tensor | None = None  # the buffers of the last completed step
        self._committed_layout: list[tuple[str, torch.dtype, torch.Size, int]] = []
        self._source = "none"
        unsupported = sorted(
            {str(getattr(m, a).dtype) for m, a, _ in self._slots} - {str(d) for d in _EXCHANGEABLE}
        )
        self.exchange = world_size > 1 and not unsupported
        if world_size > 1 and unsupported:
            log.warning(
                "buffers of dtype %s cannot ride on the control allreduce: a just-in-time checkpoint "
                "written by a rank other than 0 holds that rank's own buffers",
                ", ".join(unsupported),
            )

    @property
    def enabled(self) -> bool:
        return bool(self._slots)

    def capture(self, *, identical: bool = False) -> torch.Tensor | None:
        """Copy this rank's buffers; returns its float64 contribution to the control allreduce
        (``None``: nothing to exchange; pass ``None`` to :meth:`commit` then).

        With ``identical=True`` (at the start: every rank loaded the same checkpoint, or was
        seeded alike) the copy is committed at once as the buffers of the current step.
        """
        if not self.enabled:
            return None
        live = [getattr(module, attr) for module, attr, _ in self._slots]
        if len(live) != len(self._live) or any(
            a is not b for a, b in zip(live, self._live, strict=False)
        ):
            self._relayout(live)  # first step, or a module replaced a buffer
        # One kernel launch for all buffers (dtype conversion included); the copy is reused
        # from step to step: the control allreduce gets a copy of it (torch.cat), never the
        # tensor itself, and commit() keeps the reduced control tensor, not this one.
        try:
            torch_compat.foreach_copy_(self._views, live)
        except RuntimeError:  # a buffer was resized in place
            self._relayout(live)
            torch_compat.foreach_copy_(self._views, live)
        if identical:
            self._commit_own("rank0")
            return None
        if not self.exchange:
            return None
        return self._own if self._rank == 0 else self._negative_zeros

    def commit(self, reduced: torch.Tensor | None) -> None:
        """Inside the update section, after the step's control allreduce completed: ``reduced``
        is its buffer part (rank 0's values; kept, not copied: the control tensor is not reused),
        or ``None`` when :meth:`capture` returned ``None`` (this rank's own copy is kept)."""
        if not self.enabled:
            return
        if reduced is not None:
            self._committed, self._committed_layout, self._source = reduced, self._layout, "rank0"
            if self._apply:
                self._write_live(reduced)
        else:
            exact = self._rank == 0 or self._world_size == 1
            self._commit_own("rank0" if exact else "local")

    def _write_live(self, reduced: torch.Tensor) -> None:
        # The control channel alternates between two tensors: their views are cut once per layout.
        views = self._applied_views.get(reduced.data_ptr())
        if views is None:
            views, offset = [], 0
            for _, _, shape, numel in self._layout:
                views.append(reduced[offset : offset + numel].view(shape))
                offset += numel
            self._applied_views[reduced.data_ptr()] = views
        with torch.no_grad():
            torch_compat.foreach_copy_(self._live, views)

    def _commit_own(self, source: str) -> None:
        # Copied into a second buffer kept from step to step, not cloned: no allocation per step.
        # Overwriting the buffer that a snapshot read is safe: this runs inside the update
        # section (or before training starts), snapshot() runs holding the same guard and
        # returns copies, and on CUDA the saver's reads end (stream synchronised) before it
        # releases the guard (see device_snapshot). A relayout allocates a new buffer, so the
        # previous step's stays intact until this commit replaces it.
        if self._own is None or self._own_committed is None:
            raise RuntimeError("buffers committed before any were captured")
        self._own_committed.copy_(self._own)
        self._committed, self._committed_layout, self._source = (
            self._own_committed,
            self._layout,
            source,
        )

    def _relayout(self, live: list[torch.Tensor]) -> None:
        self._live = live
        self._applied_views = {}
        self._layout = [
            (key, t.dtype, t.shape, t.numel())
            for (_, _, key), t in zip(self._slots, live, strict=True)
        ]
        layout = self._layout
        self._own = torch.empty(
            sum(n for *_, n in layout), dtype=torch.float64, device=live[0].device
        )
        self._views, offset = [], 0
        for _, _, shape, numel in layout:
            self._views.append(self._own[offset : offset + numel].view(shape))
            offset += numel
        self._negative_zeros = torch.full_like(self._own, -0.0)
        # A new tensor, never the old one resized: _committed may still be the old one (the last
        # completed step's buffers, in the old layout) until the step in progress commits.
        self._own_committed = torch.empty_like(self._own)

    def snapshot(self) -> tuple[dict[str, torch.Tensor], str]:
        """Buffers of the last completed step (caller holds the guard), and where they come from:
        ``"rank0"`` (what rank 0 would have saved) or ``"local"`` (dtypes that cannot be
        exchanged, saved by another rank).

        The tensors are copies (``clone``, also where the dtype is already float64): the next
        update overwrites the committed buffer in place."""
        if not self.enabled or self._committed is None:
            return {}, "none"
        out, offset, flat = {}, 0, self._committed
        for key, dtype, shape, numel in self._committed_layout:
            out[key] = flat[offset : offset + numel].to(dtype).reshape(shape).clone()
            offset += numel
        return out, self._source
