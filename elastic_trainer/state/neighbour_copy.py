"""Each rank keeps its neighbour's shard in host memory, so that a lost rank's shard survives it.

    copies = NeighbourCopy(lambda step: local_state(model, [opt], objects, step=step),
                           env=env, every=1, group=dist.new_group(backend="gloo"))
    with copies.update(step + 1):       # the optimizer step, the sampler's advance
        optimizer.step(); sampler.advance(plan)
    # on leaving: every `every` steps, this rank's shard is staged into host memory and sent to
    # its holder (rank - 1) on a background thread, while its neighbour's (rank + 1) arrives

Ring: rank ``r`` holds the shard of rank ``(r + s) % W`` (:func:`neighbour_of`); rank ``r``'s
copy lives on :func:`holder_of` ``(r - s) % W``. The stride ``s`` (:func:`ring_stride`) is the
ranks per node when the job spans whole nodes, so that every copy lives on another node and a lost
node's shards survive it; else 1. One lost rank's shard is always somewhere; a rank lost together
with its holder loses its shard, and the job falls back to the newest checkpoint. On an HSDP mesh (``replicas`` > 1) the replicas of a shard are its copies:
nothing is sent, and each rank only stages its own shard (``mode`` ``"replica"``), so that ranks a
step apart (a replica died between the two all-reduces of a step) meet at the older step.

Invariants: what is sent, kept and handed on is a completed step (staged on leaving
:meth:`update`, never during one). Two generations are kept of this rank's own staged shard
and of the neighbour's received one (a copy whose transfer was cut by a fault is not a
copy, and the generation before it still is): a heal can go back to any step both sides hold
(``heal/sharded_restore.py`` decides which). The staging is the only work on the training
thread (one copy into reused host buffers, pinned on CUDA, taken on a side stream); the
exchange runs on a gloo group of its own, on a background thread. Design:
``docs/design/sharded.md`` ("Healing sharded state in place"); cost: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.runtime.settings import (
    ENV_SHARD_COPY_EVERY,  # overrides NeighbourCopyConfig.every
)
from elastic_trainer.state import flat as flat_payload

log = logging.getLogger(__name__)

NO_STATE = -1
"""The step of a rank that holds no completed step (as ``heal.protocol.NO_STATE``)."""
GENERATIONS = 2


def ring_stride(world_size: int, local_world_size: int) -> int:
    """Ranks between a shard and its copy: a node's ranks when the job spans two or more whole
    nodes (torchrun numbers a node's ranks contiguously), so the copy is on the next node; else 1."""
    if 1 < local_world_size < world_size and world_size % local_world_size == 0:
        return local_world_size
    return 1


def neighbour_of(rank: int, world_size: int, stride: int = 1) -> int:
    """The rank whose shard ``rank`` holds."""
    return (rank + stride) % world_size


def holder_of(rank: int, world_size: int, stride: int = 1) -> int:
    """The rank that holds ``rank``'s shard."""
    return (rank - stride) % world_size


@dataclass(kw_only=True, slots=True)
class NeighbourCopyConfig:
    """The redundant copy of every rank's shard (FSDP): how often it is refreshed."""

    every: int = 1
    """Steps between refreshes of the copy (1: every step; 0: off, and a lost shard comes from the
    newest checkpoint). A heal goes back to the newest step every copy holds: up to
    ``every - 1`` steps are redone."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ConfigError(f"shard_copy.every: must be an integer >= 0, got {self.every!r}")

    @classmethod
    def from_environ(
        cls, env: Mapping[str, str] | None = None, *, every: int | None = None
    ) -> NeighbourCopyConfig:
        """``every`` (a flag) > :data:`ENV_SHARD_COPY_EVERY` > the default."""
        env = os.environ if env is None else env
        if every is None and env.get(ENV_SHARD_COPY_EVERY, "").strip():
            raw = env[ENV_SHARD_COPY_EVERY].strip()
            try:
                every = int(raw)
            except ValueError as exc:
                raise ConfigError(f"{ENV_SHARD_COPY_EVERY}: {raw!r} is not an integer") from exc
        return cls() if every is None else cls(every=every)


@dataclass(frozen=True, slots=True)
class Holdings:
    """What one rank can hand on at a heal (all-gathered, then ``plan_restore``)."""

    rank: int
    world_size: int
    replicas: int
    """Replicas of each shard (HSDP's replicate dimension; 1: FSDP)."""
    live: int
    """The step of the live state (``NO_STATE``: an update did not complete)."""
    own: tuple[int, ...] = ()
    """Steps of this rank's own staged shard."""
    copies: tuple[tuple[int, int], ...] = ()
    """``(shard rank, step)`` of the neighbour copies received whole."""
    every: int = 1
    stride: int = 1
    """The ring's stride (:func:`ring_stride`): this rank's copy is on ``rank - stride``."""

    @property
    def shard(self) -> int:
        """Which shard this rank holds (HSDP: ranks ``s, s + S, s + 2S, ...`` hold shard ``s``)."""
        return self.rank % (self.world_size // self.replicas)


def _posted(work: Any) -> Any:
    if work is None:  # this rank is not in the group: a bug, not a fault
        raise RuntimeError("the neighbour copy's group does not hold this rank")
    return work


@dataclass(slots=True)
class _Slot:
    step: int = NO_STATE
    header: bytes = b""
    flat: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    shard: int = -1


class NeighbourCopy:
    """See the module docstring.

    Args:
        source: ``source(step)`` is this rank's local state after ``step`` (``local_shards.local_state``).
        env: this worker's place in the job.
        every: steps between refreshes (0: off).
        group: a gloo group of all ranks for the exchange, used by nobody else (``None``: created).
        replicas: HSDP's replicate dimension (> 1: the replicas are the copies; nothing is sent).
    """

    def __init__(
        self,
        source: Callable[[int], dict[str, Any]],
        *,
        env: DistEnv,
        every: int = 1,
        group: Any = None,
        replicas: int = 1,
    ) -> None:
        if every < 0:
            raise ConfigError(f"shard_copy.every: must be >= 0, got {every}")
        if replicas < 1 or env.world_size % replicas:
            raise ConfigError(
                f"replicas: {replicas} does not divide the world size {env.world_size}"
            )
        self.source = source
        self.env = env
        self.replicas = replicas
        self.mode = (
            "off" if every == 0 or env.world_size == 1 else ("replica" if replicas > 1 else "ring")
        )
        self.every = every if self.mode != "off" else 0
        self.step = NO_STATE
        """The step of the live state (``NO_STATE`` while an update is under way or failed)."""
        self._group = group
        if self.mode == "ring" and self._group is None:
            self._group = dist.new_group(backend="gloo")
        self.stride = 1
        """The ring's stride, agreed by every rank (nodes of different sizes give 1)."""
        if self.mode == "ring":
            mine = torch.tensor([ring_stride(env.world_size, env.local_world_size)])
            dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=self._group)
            self.stride = int(mine.item())
        self._own = [_Slot() for _ in range(GENERATIONS)]
        self._copies = [_Slot() for _ in range(GENERATIONS)]
        self._lock = threading.Lock()  # the slots' steps and the newest index
        self._own_newest = self._copy_newest = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pinned = env.device.type == "cuda"
        self._stream = torch.cuda.Stream(env.device) if self._pinned else None
        self._stopped = threading.Event()
        self._finishing = threading.Event()
        self._parked = threading.Event()
        self._stopped_forever = threading.Event()  # never set
        self._last_update_end: float | None = None
        self.step_s: float | None = None
        """The time between the last two update ends (what a finishing stop waits, thrice)."""
        self.stage_s = 0.0
        """Seconds the training thread spent staging, in total."""
        self.refreshes = 0

    # -- the training thread ------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """The live state is now that of ``step`` (after a load or a restore); refresh at once."""
        self.step = step
        self._refresh(step)

    @contextlib.contextmanager
    def update(self, step: int) -> Iterator[None]:
        """Around everything that turns step ``step - 1`` into ``step``; a copy of it on leaving
        (after :meth:`stop`: the training thread waits here instead, until the process ends)."""
        self.step = NO_STATE
        yield
        if self._stopped.is_set():
            self._park()
        self.step = step
        now = time.monotonic()
        if self._last_update_end is not None:
            self.step_s = now - self._last_update_end
        self._last_update_end = now
        self._refresh(step)
        if self._finishing.is_set():
            self._park()

    def _park(self) -> None:
        """(Training thread) wait here until the process ends."""
        self._parked.set()
        self._stopped_forever.wait()

    def stop(self) -> None:
        """(Any thread) no step is completed or staged after this: the training thread waits at
        the end of its next update until the process ends. What a stop signal's save reads from
        the copies then stays the newest step the job completed."""
        self._stopped.set()

    def stop_after_update(self, timeout: float) -> bool:
        """(Another thread) a stop that lets the training thread stage the step of the update it
        is in, or of the next one it ends, before it parks; waits up to ``timeout`` seconds for
        that, then stops as :meth:`stop` does. Returns whether the training thread parked.

        On a stop signal the ranks are a few milliseconds apart: a rank inside the update of step
        ``S`` would otherwise stage nothing newer than ``S - 1`` while a peer that ended ``S``
        first holds ``S``, and the set of ``S`` is incomplete (a step redone). A rank whose next
        update cannot end (a collective with a peer that already parked) waits out ``timeout``
        and keeps what it holds, which its peers hold too."""
        if self.mode == "off" or self._stopped.is_set():
            self.stop()
            return self._parked.is_set()
        self._finishing.set()
        deadline = time.monotonic() + max(0.0, timeout)
        while not self._parked.wait(0.01):  # a failing training thread stops instead: no wait
            if self._stopped.is_set() or time.monotonic() >= deadline:
                break
        parked = self._parked.is_set()
        self.stop()
        if parked and self.due(self.step) and self._thread is not None and self._stream is not None:
            # CUDA, ring: the exchange thread marks the staged shard once its copy has landed.
            deadline = time.monotonic() + min(1.0, max(0.0, timeout))
            while self._own[self._own_newest].step != self.step and time.monotonic() < deadline:
                time.sleep(0.005)
        return parked

    def finish_timeout(self, *, floor: float = 0.5, ceiling: float = 5.0) -> float:
        """How long :meth:`stop_after_update` should wait: three recent steps, within bounds."""
        return min(ceiling, max(floor, 3.0 * (self.step_s or ceiling / 3.0)))

    def due(self, step: int) -> bool:
        return self.mode != "off" and step % self.every == 0

    def _refresh(self, step: int) -> None:
        if not self.due(step):
            return
        started = time.monotonic()
        self.wait()
        packed = flat_payload.pack(self.source(step))
        with self._lock:
            target = 1 - self._own_newest
            slot = self._own[target]
            slot.step = NO_STATE  # being overwritten
        if slot.flat.numel() != packed.total:
            slot.flat = torch.empty(packed.total, dtype=torch.uint8, pin_memory=self._pinned)
        event = None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.env.device))
            with torch.cuda.stream(self._stream):
                flat_payload.fill(packed, slot.flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            flat_payload.fill(packed, slot.flat)
        # Which shard this is (HSDP: ranks s, s + S, ... hold shard s; FSDP: its rank's own).
        slot.header, slot.shard = (
            packed.header,
            self.env.rank % (self.env.world_size // self.replicas),
        )
        self.stage_s += time.monotonic() - started
        self.refreshes += 1
        if self.mode == "replica" or event is None:
            # Staged (host memory: at once; CUDA's side stream: once it has landed). A stop's
            # save reads the holdings at any moment: the step is held from here, not only once
            # the exchange thread starts.
            if event is not None:
                event.synchronize()
            with self._lock:
                slot.step, self._own_newest = step, target
            if self.mode == "replica":  # the replicas are the copies: only this rank's is kept
                return
        self._thread = threading.Thread(
            target=self._exchange, args=(step, target, event), name="neighbour-copy", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Wait for the exchange under way; re-raise its failure (a peer died: the caller heals)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- the exchange thread ---------------------------------------------------------------------------
    def _exchange(self, step: int, own: int, event: Any) -> None:
        try:
            if event is not None:
                event.synchronize()  # the staging copies have landed in host memory
            slot = self._own[own]
            with self._lock:
                slot.step = step
                self._own_newest = own
            world, rank = self.env.world_size, self.env.rank
            stride = self.stride
            holder, neighbour = holder_of(rank, world, stride), neighbour_of(rank, world, stride)
            sizes = torch.tensor([step, len(slot.header), slot.flat.numel()], dtype=torch.int64)
            header = torch.frombuffer(bytearray(slot.header), dtype=torch.uint8)
            sends = [
                _posted(dist.isend(t, holder, group=self._group))
                for t in (sizes, header, slot.flat)
                if t.numel()
            ]
            got = torch.empty(3, dtype=torch.int64)
            _posted(dist.irecv(got, neighbour, group=self._group)).wait()
            with self._lock:
                target = 1 - self._copy_newest
                into = self._copies[target]
                into.step = NO_STATE
            their_header = torch.empty(int(got[1]), dtype=torch.uint8)
            if into.flat.numel() != int(got[2]):
                into.flat = torch.empty(int(got[2]), dtype=torch.uint8)
            receives = [
                _posted(dist.irecv(t, neighbour, group=self._group))
                for t in (their_header, into.flat)
                if t.numel()
            ]
            for work in receives + sends:
                work.wait()
            into.header, into.shard = their_header.numpy().tobytes(), neighbour
            with self._lock:
                into.step = int(got[0])
                self._copy_newest = target
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    # -- a heal ----------------------------------------------------------------------------------------
    def holdings(self) -> Holdings:
        """What this rank can hand on now (the exchange under way is not waited for: a transfer
        cut by the fault is no copy, and the generation before it is)."""
        with self._lock:
            own = tuple(s.step for s in self._own if s.step != NO_STATE)
            copies = tuple((s.shard, s.step) for s in self._copies if s.step != NO_STATE)
        return Holdings(
            rank=self.env.rank,
            world_size=self.env.world_size,
            replicas=self.replicas,
            live=self.step,
            own=own,
            copies=copies,
            every=self.every,
            stride=self.stride,
        )

    def payload(self, what: str, *, shard: int, step: int) -> dict[str, Any]:
        """This rank's ``what`` (``"live"``, ``"own"`` or ``"copy"``) of ``shard`` at ``step``,
        in host memory (live: the live tensors themselves).

        Raises:
            LookupError: it holds no such thing (the plan was made from stale holdings).
        """
        if what == "live":
            if self.step != step:
                raise LookupError(f"the live state is of step {self.step}, not {step}")
            return self.source(step)
        with self._lock:
            slots = self._own if what == "own" else self._copies
            for slot in slots:
                if slot.step == step and slot.shard == shard:
                    return flat_payload.unpack(
                        flat_payload.read_header(slot.header), slot.flat, torch.device("cpu")
                    )  # type: ignore[no-any-return]
        raise LookupError(f"no {what} copy of rank {shard}'s shard at step {step} here")
