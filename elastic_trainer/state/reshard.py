"""Cutting the local shards of a new world size out of those of the old one, in memory.

    cut = Resharder(layout, old_world=4, new_world=2, rank=1)   # layout: local_state's LAYOUT
    for shard in cut.needed():                                  # old ranks overlapping rank 1
        cut.take(shard, payload_of(shard))                      # keeps only the rows it needs
    payload = cut.result()                                      # load_local_state(...) takes it

FSDP2 shards every parameter (and so AdamW's ``exp_avg``/``exp_avg_sq`` of it) on dim 0 of a 1-D
mesh with ``torch.chunk`` rows: ``ceil(D / N)`` rows per rank, the trailing ranks fewer or none
(an empty shard keeps its other dims: ``(0, 5)``); checked on torch 2.13 against ``fully_shard``
and ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, whose offsets are
clamped to ``D`` as :func:`chunk_rows`'s are. New rank ``j``'s rows of an entry are those of the
old shards overlapping its new chunk (:func:`pieces`), concatenated in order: exactly what DCP's
resharded load reads from a checkpoint, without the disk.

Invariants: a :class:`Resharder` keeps only the rows of its own new chunk (an old shard it is
handed is sliced, not kept), so a rank never holds more than its new shard plus the old shard
in hand; every non-shard entry (the optimizer's ``step`` scalars and hyper-parameters, the
sampler's cursor, replicated buffers) comes from the first old payload it takes, as they are
alike on every rank. An HSDP layout (``local_shards.HSDP_DIM0``) is cut the same way over its
shard dim: the caller counts shards, not ranks (each replica holds the same ones).
:func:`unsupported` says why a layout cannot be resharded (another placement): the caller falls
back to the checkpoint. Design:
``docs/design/sharded.md`` ("Healing sharded state in place").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic_trainer.state.local_shards import DIM0, FORMAT, HSDP_DIM0, LAYOUT, SHARD


def chunk_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``rows`` are split into ``parts`` like
    ``torch.chunk`` (and FSDP2): ``ceil(rows / parts)`` each, the trailing chunks shorter or
    empty (``start`` clamped to ``rows``)."""
    if parts <= 0 or not 0 <= index < parts:
        raise ValueError(f"chunk {index} of {parts}")
    size = -(-rows // parts)
    start = min(index * size, rows)
    return start, min(start + size, rows)


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[start, stop)`` of old shard ``shard``'s local tensor (its own row numbers)."""

    shard: int
    start: int
    stop: int


def pieces(rows: int, *, old_world: int, new_world: int, rank: int) -> list[Piece]:
    """The rows of old shards that make new rank ``rank``'s chunk of a ``rows``-row entry, in
    order (empty when its new chunk is empty)."""
    begin, end = chunk_rows(rows, new_world, rank)
    found = []
    for shard in range(old_world):
        start, stop = chunk_rows(rows, old_world, shard)
        low, high = max(begin, start), min(end, stop)
        if low < high:
            found.append(Piece(shard, low - start, high - start))
    return found


def unsupported(layout: Mapping[Any, Any] | None) -> str | None:
    """Why a payload of this layout cannot be resharded in place (``None``: it can)."""
    if not layout:
        return "the shards carry no layout"
    kinds = set()
    for path, (shape, placement) in layout.items():
        if placement not in (DIM0, HSDP_DIM0):
            return f"{'.'.join(map(str, path))} is placed {placement}, not on dim 0 of a 1-D mesh"
        if not shape:
            return f"{'.'.join(map(str, path))} is a sharded scalar"
        kinds.add(placement)
    if len(kinds) > 1:
        return "its entries are placed on meshes of different shapes"
    return None


def _shards(value: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """Every ``{SHARD: tensor}`` in ``value`` with its path (``local_shards`` marks them so)."""
    if isinstance(value, dict):
        if len(value) == 1 and SHARD in value:
            yield path, value[SHARD]
            return
        for key, item in value.items():
            yield from _shards(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _shards(item, (*path, i))


def _replace(value: Any, path: tuple[Any, ...], new: Mapping[tuple[Any, ...], Any]) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and SHARD in value:
            return {SHARD: new[path]}
        return {key: _replace(item, (*path, key), new) for key, item in value.items()}
    if isinstance(value, list):
        return [_replace(item, (*path, i), new) for i, item in enumerate(value)]
    return value


class Resharder:
    """New rank ``rank``'s local shards at ``new_world`` ranks, cut from the old shards of a
    payload taken at ``old_world`` ranks (see the module docstring).

    Raises:
        ValueError: the layout cannot be resharded (:func:`unsupported`), or a payload handed to
            :meth:`take` does not fit it.
    """

    def __init__(
        self, layout: Mapping[Any, Any], *, old_world: int, new_world: int, rank: int
    ) -> None:
        reason = unsupported(layout)
        if reason is not None:
            raise ValueError(f"cannot reshard in place: {reason}")
        self.old_world, self.new_world, self.rank = old_world, new_world, rank
        self.layout = {
            tuple(path): [list(shape), placement] for path, (shape, placement) in layout.items()
        }
        self._pieces = {
            path: pieces(shape[0], old_world=old_world, new_world=new_world, rank=rank)
            for path, (shape, _) in self.layout.items()
        }
        self._kept: dict[tuple[Any, ...], list[torch.Tensor]] = {path: [] for path in self.layout}
        self._taken: set[int] = set()
        self._skeleton: Mapping[str, Any] | None = None

    def needed(self) -> list[int]:
        """The old shards that hold rows of this rank's new chunk, in order (at least one: the
        entries that are no shards, and an empty chunk's dtype, come from the first taken)."""
        return sorted({p.shard for found in self._pieces.values() for p in found}) or [0]

    def take(self, shard: int, payload: Mapping[str, Any]) -> None:
        """Keep the rows of old shard ``shard`` (its ``local_state`` payload) this rank needs."""
        if payload.get("format") != FORMAT:
            raise ValueError(f"old shard {shard}: not a {FORMAT} payload")
        if shard in self._taken or not 0 <= shard < self.old_world:
            raise ValueError(f"old shard {shard} taken twice or out of range")
        found = dict(_shards({k: payload[k] for k in ("model", "optimizers")}, ()))
        if found.keys() != self.layout.keys():
            raise ValueError(f"old shard {shard} holds other entries than the layout names")
        for path, local in found.items():
            shape = self.layout[path][0]
            start, stop = chunk_rows(shape[0], self.old_world, shard)
            if list(local.shape) != [stop - start, *shape[1:]]:
                raise ValueError(
                    f"old shard {shard} of {'.'.join(map(str, path))}: shape "
                    f"{tuple(local.shape)}, the layout says {stop - start} of {tuple(shape)} rows"
                )
            if self._skeleton is None:  # an empty chunk still needs its dtype and other dims
                self._kept[path].append(local[0:0].clone())
            for piece in self._pieces[path]:
                if piece.shard == shard:
                    self._kept[path].append(local[piece.start : piece.stop].clone())
        if self._skeleton is None:
            self._skeleton = {
                key: value for key, value in payload.items() if key not in ("model", "optimizers")
            } | {
                "model": _replace(payload["model"], ("model",), dict.fromkeys(found)),
                "optimizers": _replace(
                    payload["optimizers"], ("optimizers",), dict.fromkeys(found)
                ),
            }
        self._taken.add(shard)

    def result(self) -> dict[str, Any]:
        """This rank's payload at the new world size (``local_shards`` format, new layout).

        Raises:
            ValueError: a needed old shard was not taken.
        """
        missing = [s for s in self.needed() if s not in self._taken]
        if self._skeleton is None or missing:
            raise ValueError(f"old shard(s) {missing or 'any'} not taken")
        new = {path: torch.cat(kept) for path, kept in self._kept.items()}
        skeleton = self._skeleton
        return {
            key: value for key, value in skeleton.items() if key not in ("model", "optimizers")
        } | {
            "model": _replace(skeleton["model"], ("model",), new),
            "optimizers": _replace(skeleton["optimizers"], ("optimizers",), new),
            LAYOUT: dict(self.layout),
        }
