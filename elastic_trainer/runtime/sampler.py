"""The elastic sampler: a global data order with a cursor, re-partitioned over any world size.

Each epoch is one global order (a permutation seeded by ``seed + epoch``, as
``DistributedSampler``'s), consumed in optimizer steps of ``global_batch_size`` samples; the only
state is the *global cursor*. Step ``k`` takes ``order[cursor : cursor + global_batch_size]`` and
splits it over the ranks alive now, so after a restart at any world size every sample is still
used exactly once per epoch (``DistributedSampler`` fixes each rank's slice at the epoch's start
and repeats or skips samples instead). Everything a rank sees is a pure function of
``(seed, epoch, cursor, world_size, rank)``.

Every rank runs the same number of micro-batches (DDP needs equal backward passes); a rank whose
share is smaller (only in an epoch's last, short step) gets *padding* micro-batches: one real
index, loss weight 0. Design: ``docs/design/exact-resume.md``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One forward/backward of one rank."""

    indices: tuple[int, ...]
    """Dataset indices to load."""
    samples: int
    """How many of them count (0 for padding, else ``len(indices)``)."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one rank does in one optimizer step."""

    epoch: int
    cursor: int
    """Samples of this epoch consumed before this step (global, over all ranks)."""
    global_samples: int
    """Samples in this step over all ranks (``global_batch_size`` except at the end of an epoch)."""
    micro_batches: tuple[MicroBatch, ...]

    @property
    def samples(self) -> int:
        """Samples this rank contributes to the step (padding excluded)."""
        return sum(mb.samples for mb in self.micro_batches)

    @property
    def indices(self) -> list[int]:
        """Dataset indices this rank contributes (padding excluded)."""
        return [i for mb in self.micro_batches if mb.samples for i in mb.indices]

    @property
    def next_cursor(self) -> int:
        return self.cursor + self.global_samples


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes differing by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class ElasticSampler:
    """Deterministic global order per epoch plus a global cursor; see the module docstring.

    Args:
        dataset_size: number of samples.
        global_batch_size: samples per optimizer step over all ranks.
        seed: the order of epoch ``e`` is ``randperm(dataset_size)`` seeded with ``seed + e``.
        shuffle: ``False`` keeps the dataset order.
        micro_batch_size: cap on one rank's forward; ``None`` for no cap.
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        micro_batch_size: int | None = None,
    ) -> None:
        if dataset_size <= 0:
            raise ValueError(f"dataset_size: must be positive, got {dataset_size}")
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size: must be positive, got {global_batch_size}")
        if micro_batch_size is not None and micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size: must be positive, got {micro_batch_size}")
        if dataset_size < global_batch_size:
            log.warning(
                "the dataset holds %d samples, fewer than global_batch_size %d: every step trains "
                "the whole dataset, %d samples (an epoch per step)",
                dataset_size,
                global_batch_size,
                dataset_size,
            )
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.micro_batch_size = micro_batch_size
        self.epoch = 0
        self.cursor = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []

    # -- DistributedSampler-like API ---------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its beginning (as ``DistributedSampler.set_epoch``), unless the
        sampler is already positioned inside that epoch by :meth:`load_state_dict`."""
        if epoch < 0:
            raise ValueError(f"epoch: must be non-negative, got {epoch}")
        if epoch != self.epoch:
            self.epoch = epoch
            self.cursor = 0

    def __len__(self) -> int:
        """Optimizer steps in a full epoch."""
        return math.ceil(self.dataset_size / self.global_batch_size)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor <= self.dataset_size:
            raise ValueError(f"sampler state out of range for {self.dataset_size} samples: {state}")
        self.epoch, self.cursor = epoch, cursor

    @property
    def epoch_done(self) -> bool:
        return self.cursor >= self.dataset_size

    def advance(self, plan: StepPlan) -> None:
        """Mark ``plan``'s samples consumed (call after the optimizer step)."""
        if plan.epoch != self.epoch or plan.cursor != self.cursor:
            raise RuntimeError(
                f"step plan at epoch {plan.epoch} cursor {plan.cursor} is not the next step "
                f"(sampler at epoch {self.epoch} cursor {self.cursor})"
            )
        self.cursor = plan.next_cursor

    # -- the order and the plans -----------------------------------------------------------------
    def order(self, epoch: int | None = None) -> list[int]:
        """The global order of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self._order_epoch != epoch:
            if self.shuffle:
                generator = torch.Generator()
                generator.manual_seed(self.seed + epoch)
                self._order = torch.randperm(self.dataset_size, generator=generator).tolist()
            else:
                self._order = list(range(self.dataset_size))
            self._order_epoch = epoch
        return self._order

    def micro_steps(self, global_samples: int, world_size: int) -> int:
        """Micro-batches every rank runs for a step of ``global_samples`` samples."""
        largest_share = math.ceil(global_samples / world_size)
        if self.micro_batch_size is None:
            return 1
        return max(1, math.ceil(largest_share / self.micro_batch_size))

    def plan(self, cursor: int, rank: int, world_size: int) -> StepPlan:
        """The step that starts at ``cursor`` in the current epoch, as seen by ``rank``."""
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if not 0 <= cursor < self.dataset_size:
            raise ValueError(f"cursor {cursor} is outside the epoch of {self.dataset_size} samples")
        order = self.order()
        global_samples = min(self.global_batch_size, self.dataset_size - cursor)
        shares = split_evenly(global_samples, world_size)
        start = cursor + sum(shares[:rank])
        share = order[start : start + shares[rank]]
        micro = []
        offset = 0
        for size in split_evenly(len(share), self.micro_steps(global_samples, world_size)):
            if size:
                micro.append(MicroBatch(indices=tuple(share[offset : offset + size]), samples=size))
            else:
                # Padding keeps the backward count equal on every rank; its loss weight is zero.
                micro.append(MicroBatch(indices=(order[cursor],), samples=0))
            offset += size
        return StepPlan(
            epoch=self.epoch,
            cursor=cursor,
            global_samples=global_samples,
            micro_batches=tuple(micro),
        )

    def plans(self, rank: int, world_size: int) -> Iterator[StepPlan]:
        """This rank's remaining steps of the current epoch, from the current cursor.

        The iterator does not move the cursor (a DataLoader may read ahead); the trainer calls
        :meth:`advance` once a step is done.
        """
        cursor = self.cursor
        while cursor < self.dataset_size:
            plan = self.plan(cursor, rank, world_size)
            yield plan
            cursor = plan.next_cursor


class MicroBatchSampler:
    """The micro-batches of :meth:`ElasticSampler.plans`, flattened, as a DataLoader
    ``batch_sampler`` (one list of indices per forward)."""

    def __init__(self, sampler: ElasticSampler, rank: int, world_size: int) -> None:
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[list[int]]:
        for plan in self.sampler.plans(self.rank, self.world_size):
            for micro in plan.micro_batches:
                yield list(micro.indices)

    def __len__(self) -> int:
        return sum(len(p.micro_batches) for p in self.sampler.plans(self.rank, self.world_size))
