"""The training state: what is saved, restored and handed to a peer, in one object.

    state = TrainingState({"model": model, "optimizer": opt, "sampler": sampler}, env=env, seed=0)
    with state.update(step + 1):                 # every change of the state, under its guard
        optimizer.step()
    payload = state.state_dict()                 # what a checkpoint holds (live tensors)
    state.load_state_dict(payload)               # a checkpoint's or a peer's; returns what it restored

Invariants: the state changes only inside :meth:`TrainingState.update` (a snapshot taken holding
the guard is one completed step, never half of the next); :meth:`snapshot` is a host copy of the
last completed step with rank 0's module buffers of that step, so any rank can stand in for rank
0; the checkpoint writer (``elastic_trainer.checkpoint``) and the heal path
(``elastic_trainer.heal``) move this object's payload and never reach into each other.

What is saved is found, not listed (:func:`find_states`): every optimizer over the model's
parameters and every LR scheduler of one of them. An optimizer over the model that steps while
it is not part of the state is refused at its first step (:meth:`TrainingState.watch`), before it
can change anything: after a heal or a resume it would silently differ between ranks. After a
heal, :meth:`verify_replicas` compares a checksum of every saved object over all ranks (one small
allreduce), so a ``load_state_dict`` that does not restore everything is found at once.

Sharded models (FSDP2, DTensor parameters) are recognised here, once, at construction
(:attr:`TrainingState.sharded`): the model and its optimizers are then read and written through
``torch.distributed.checkpoint.state_dict`` (:class:`~elastic_trainer.state.sharded.ShardedState`),
each rank holding only its own shards, and the checkpoint manager writes them as sharded (DCP)
checkpoints, every rank its own shards. A replicated (DDP) model keeps plain state dicts and rank
0's single-file checkpoints. Everything else follows that one decision (``docs/design/sharded.md``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import struct
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from elastic_trainer.runtime import rng
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.state.buffers import AuthoritativeBuffers
from elastic_trainer.state.guard import StateGuard
from elastic_trainer.state.host_copy import device_snapshot, host_state_dict, snapshot_to_cpu
from elastic_trainer.state.neighbour_copy import NeighbourCopy
from elastic_trainer.state.rebuilt_links import follow_rebuild
from elastic_trainer.state.sharded import ShardedState, is_sharded

log = logging.getLogger(__name__)

BOOKKEEPING = ("format", "rng", "step", "epoch", "world_size", "fingerprint", "config", "jit")
"""Keys of a payload that are not saved objects."""


class Stateful(Protocol):
    """What the state saves: anything with ``state_dict`` and ``load_state_dict``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class UnsavedStateError(ConfigError):
    """An object that changes the training (an optimizer over the model) is not saved."""


class ReplicaMismatchError(RuntimeError):
    """After a heal the ranks hold different states (a ``load_state_dict`` restored less than its
    ``state_dict`` saved); the job falls back to the newest checkpoint."""


def find_states(model: nn.Module, *, scaler: Any = None) -> dict[str, Stateful]:
    """The optimizers over ``model``'s parameters and their LR schedulers, found among the live
    objects, named ``optimizer``, ``optimizer_1``, ... and ``scheduler``, ``scheduler_1``, ...;
    ``scaler`` (a ``GradScaler``) as ``scaler``.

    The names must be the same on every rank and in every restart of the script (a checkpoint is
    loaded by name): optimizers are ordered by where their parameters are in
    ``model.parameters()``, schedulers by their optimizer's place, then by class name.
    """
    place = {id(p): i for i, p in enumerate(model.parameters())}
    optimizers: list[tuple[tuple[int, ...], str, torch.optim.Optimizer]] = []
    schedulers: list[Any] = []
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that may run a proxy's __class__ (and its warnings)
        if issubclass(kind, torch.optim.Optimizer) and _over(obj, set(place)):
            where = tuple(
                place.get(id(p), -1) for group in obj.param_groups for p in group["params"]
            )
            optimizers.append((where, kind.__name__, obj))
        elif issubclass(kind, torch.optim.lr_scheduler.LRScheduler):
            schedulers.append(obj)
    optimizers.sort(
        key=lambda entry: (min((i for i in entry[0] if i >= 0), default=-1), entry[0], entry[1])
    )
    rank_of = {id(entry[2]): i for i, entry in enumerate(optimizers)}
    found: dict[str, Stateful] = {}
    for i, (_, _, optimizer) in enumerate(optimizers):
        found["optimizer" if i == 0 else f"optimizer_{i}"] = optimizer
    ours = sorted(
        (s for s in schedulers if id(getattr(s, "optimizer", None)) in rank_of),
        key=lambda s: (rank_of[id(s.optimizer)], type(s).__name__),
    )
    for i, scheduler in enumerate(ours):
        found["scheduler" if i == 0 else f"scheduler_{i}"] = scheduler
    if scaler is not None:
        found["scaler"] = scaler
    return found


def _over(optimizer: torch.optim.Optimizer, params: set[int]) -> bool:
    return any(id(p) in params for group in optimizer.param_groups for p in group["params"])


def _sharded_view(
    model: nn.Module | None, objects: Mapping[str, Stateful | None]
) -> ShardedState | None:
    """The sharded view of ``objects`` when ``model`` holds DTensors: the model and every optimizer
    go through DCP's state-dict API (saved as ``model`` and ``optimizer``), the rest as they are."""
    if model is None or not is_sharded(model):
        return None
    optimizers = {
        name: obj for name, obj in objects.items() if isinstance(obj, torch.optim.Optimizer)
    }
    rest = {
        name: obj
        for name, obj in objects.items()
        if name != "model" and name not in optimizers and obj is not None
    }
    taken = {"model", "optimizer"} & set(rest)
    if taken:
        raise ConfigError(
            f"states: {sorted(taken)} name the sharded model and its optimizers; give these "
            "objects other names"
        )
    return ShardedState(model, list(optimizers.values()), objects=rest, names=optimizers)


class TrainingState:
    """One worker's training state; see the module docstring.

    Args:
        objects: name -> object to save and restore (``None`` values are saved as ``None``).
            ``"model"`` is the plain model (not the DDP wrapper); ``"sampler"`` the elastic sampler.
        env: this worker's place in the job.
        model: the module whose buffers must be rank 0's in a snapshot (defaults to
            ``objects["model"]`` when it is a module).
        seed: the job's seed (recorded with the random-number scheme).
    """

    def __init__(
        self,
        objects: Mapping[str, Stateful | None],
        *,
        env: DistEnv,
        model: nn.Module | None = None,
        seed: int | None = None,
    ) -> None:
        self.objects: dict[str, Stateful | None] = dict(objects)
        candidate = self.objects.get("model")
        self.model = (
            model
            if model is not None
            else (candidate if isinstance(candidate, nn.Module) else None)
        )
        self.env = env
        self.seed = seed
        self.step = 0
        """Optimizer steps completed (the one restored, then each :meth:`update`)."""
        self.epoch = 0
        """The epoch of the state restored (:attr:`current_epoch` follows the sampler)."""
        self.restored: list[str] | None = None
        """The objects the last :meth:`load_state_dict` restored (``None``: nothing was loaded)."""
        self.guard = StateGuard()
        self.buffers: AuthoritativeBuffers | None = None
        """Rank 0's module buffers, when a snapshot needs them (:meth:`track_buffers`)."""
        self._update_event: Any = None
        self._serve_peers = False
        self._apply_buffers = False
        self.sharded: ShardedState | None = _sharded_view(self.model, self.objects)
        """The model holds DTensor (FSDP2) state: its model and optimizers go through
        ``get_state_dict``/``set_state_dict`` and checkpoints are sharded (every rank writes its
        shards). ``None``: a replicated model, rank 0's single-file checkpoints."""
        self.copies: NeighbourCopy | None = None
        """(Sharded) the neighbour copy of this attempt's shards (:meth:`keep_copies`): refreshed
        on leaving each :meth:`update`, started at :meth:`arm`; a just-in-time save writes a lost
        rank's shards from it, and with ``heals`` a group failure heals in place from it."""
        self._copies_heal = False

    @property
    def heal_in_place(self) -> bool:
        """Whether the group can heal in place around this state. A replica (DDP) can: a live
        peer hands it on. A rank of a sharded state holds only its own shards: it can when the
        attempt keeps a neighbour copy to heal from (:meth:`keep_copies` with ``heals``: a lost
        shard comes from it, or the newest checkpoint when no copy survived), else the group
        restarts from the newest checkpoint."""
        return self.sharded is None or (self.copies is not None and self._copies_heal)

    def keep_copies(self, copies: NeighbourCopy, *, heals: bool) -> None:
        """(Sharded) this attempt's neighbour copy. ``heals``: the model can be built again on a
        healed group (``Elastic(rebuild=...)``), so a group failure heals in place from the
        copy; else the copy serves the just-in-time save only (a failure restarts the group)."""
        self.copies, self._copies_heal = copies, heals

    def rebind(self, env: DistEnv) -> None:
        """A new attempt (after an in-place heal): this rank's new place, a fresh guard, and no
        buffers or neighbour copy until the next load or restore; the objects and the step stay."""
        self.env = env
        self.guard = StateGuard()
        self.buffers = None
        self._update_event = None
        self.copies, self._copies_heal = None, False

    def replace(self, objects: Mapping[str, Stateful | None]) -> None:
        """(A new attempt of a sharded state) ``objects`` built anew on the new group replace
        those of the same names (FSDP2 binds a model and its optimizers to their mesh); their
        state comes with the next restore or load.

        Kept objects that point at a replaced one follow it or are named
        (:func:`~elastic_trainer.state.rebuilt_links.follow_rebuild`).

        Raises:
            ConfigError: a name that this state does not save.
        """
        unknown = sorted(set(objects) - set(self.objects))
        if unknown:
            raise ConfigError(
                f"rebuild returned {unknown}, which are not saved (saved: {sorted(self.objects)})"
            )
        replaced = {name: self.objects[name] for name in objects}
        self.objects.update(objects)
        # A kept scheduler built on a replaced optimizer follows the new one (rebuilt_links.py).
        follow_rebuild(self.objects, replaced, objects)
        candidate = self.objects.get("model")
        if isinstance(candidate, nn.Module):
            self.model = candidate
        self.sharded = _sharded_view(self.model, self.objects)

    # -- what it holds ------------------------------------------------------------------------------
    @property
    def current_epoch(self) -> int:
        """The epoch the state is in: the sampler's, if one is saved."""
        return int(getattr(self.objects.get("sampler"), "epoch", self.epoch))

    @property
    def consistent(self) -> bool:
        """No exception escaped an update: the state is that of :attr:`step`."""
        return self.guard.consistent

    def state_dict(self, model_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """The state's payload (live tensors; the caller copies or writes them at once).
        ``model_state`` replaces the model's own state dict (rank 0's buffers)."""
        if self.sharded is not None:
            data = self.sharded.state_dict()  # this rank's shards, keyed by parameter name
        else:
            data = {
                name: None if obj is None else obj.state_dict()
                for name, obj in self.objects.items()
            }
        if model_state is not None:
            data["model"] = model_state
        data.update(
            {
                "rng": {"scheme": rng.STEP_SCHEME, "seed": self.seed},
                "step": self.step,
                "epoch": self.current_epoch,
                "world_size": self.env.world_size,
            }
        )
        return data

    def load_state_dict(self, state: Mapping[str, Any]) -> list[str]:
        """Restore every object ``state`` holds; returns their names (an object the payload
        lacks keeps its state: a resume is exact only for what was restored)."""
        restored = []
        if self.sharded is not None:
            self.sharded.load_state_dict(state)
            restored = [
                name
                for name, obj in self.objects.items()
                if obj is not None and (name in self.sharded.owns or state.get(name) is not None)
            ]
        else:
            for name, obj in self.objects.items():
                if obj is not None and state.get(name) is not None:
                    obj.load_state_dict(state[name])
                    restored.append(name)
        self.step = int(state["step"])
        self.epoch = int(state.get("epoch", 0))
        self.restored = restored
        return restored

    def load_local_state(self, payload: Mapping[str, Any]) -> int:
        """(Sharded) restore this rank's own shards as a heal in place hands them back
        (``ShardedState.local_state`` of this rank's place); returns the step."""
        if self.sharded is None:
            raise ValueError("a local shards payload for a state that is not sharded")
        self.step = self.sharded.load_local_state(payload)
        self.epoch = self.current_epoch
        self.restored = [name for name, obj in self.objects.items() if obj is not None]
        return self.step

    def unrestored(self) -> list[str]:
        """Objects of this state that the last load did not restore."""
        restored = set(self.restored or ())
        return [
            name for name, obj in self.objects.items() if obj is not None and name not in restored
        ]

    # -- changes --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def update(self, step: int, *, buffers: torch.Tensor | None = None) -> Iterator[None]:
        """Around everything that turns "after step ``step - 1``" into "after step ``step``"
        (optimizer, scheduler, scaler, sampler): a snapshot sees one or the other.

        ``buffers``: rank 0's buffers of this step as they arrived on the step's control
        allreduce (``AuthoritativeBuffers.capture``); ``None`` keeps this rank's own.
        """
        # The neighbour copy (sharded) marks the live state as between steps until the update is
        # left, then stages the new step and sends it to its holder.
        with (
            self.copies.update(step) if self.copies is not None else contextlib.nullcontext(),
            self.guard.update(),
        ):
            yield
            self.step = step
            if self.buffers is not None:
                self.buffers.commit(buffers)
            if self._update_event is not None:
                self._update_event.record()

    def serve_peers(self) -> None:
        """This rank may be asked for its state (:meth:`peer_snapshot`) when the group heals in
        place: keep rank 0's module buffers of every completed step."""
        self._serve_peers = True

    def sync_buffers(self) -> None:
        """The model's DDP does not broadcast buffers at each forward: rank 0's buffers ride on
        every step's control allreduce and are written into every rank's module (see
        ``state.buffers.replaces_buffer_broadcast``)."""
        self._apply_buffers = True

    def track_buffers(self, needed: bool) -> None:
        """(After a load) keep rank 0's module buffers of every step when ``needed`` (just-in-time
        saves), a peer may ask for the state, or they replace DDP's broadcast."""
        env = self.env
        self.buffers = None
        if self.sharded is not None:
            # FSDP does not broadcast buffers: each rank's are its own (no DDP to stand for).
            if needed and env.device.type == "cuda":
                self._update_event = torch.cuda.Event()
            return
        if (needed or self._serve_peers or self._apply_buffers) and self.model is not None:
            self.buffers = AuthoritativeBuffers(
                self.model, rank=env.rank, world_size=env.world_size, apply=self._apply_buffers
            )
            if env.device.type == "cuda":
                self._update_event = torch.cuda.Event()

    def arm(self) -> None:
        """Training starts: the state now is a completed step (every rank holds the same buffers;
        the neighbour copy starts from it)."""
        if self.buffers is not None:
            self.buffers.capture(identical=True)
        if self.copies is not None:
            self.copies.start(self.step)

    # -- copies ---------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """(Holding the guard) a host copy of the state after the last completed step, module
        buffers included as they were then (an aborted forward may have moved them since)."""
        env = self.env

        def build() -> dict[str, Any]:
            if self.sharded is not None:  # this rank's shards (no rank stands for another)
                payload = self.state_dict()
                payload["jit"] = {"writer_rank": env.rank, "buffers": "own"}
                return payload
            model_state = self.model.state_dict() if self.model is not None else None
            source = "none"
            if self.buffers is not None and model_state is not None:
                buffers, source = self.buffers.snapshot()
                model_state.update(buffers)
            payload = self.state_dict(model_state)
            payload["jit"] = {"writer_rank": env.rank, "buffers": source}
            return payload

        copy = host_state_dict if self.sharded is not None else snapshot_to_cpu
        return device_snapshot(build, env.device, self._update_event, copy)

    def peer_snapshot(self, timeout: float) -> dict[str, Any]:
        """:meth:`snapshot`, taking the guard (within ``timeout`` seconds): what peers take when
        the group heals in place."""
        with self.guard.hold(timeout=timeout):
            return self.snapshot()

    # -- checks ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """While training: an optimizer over the model that is not part of this state is refused
        at its first step, before it changes anything (:class:`UnsavedStateError`)."""
        if self.model is None:
            yield
            return
        params = {id(p) for p in self.model.parameters()}
        saved = {id(obj) for obj in self.objects.values() if obj is not None}
        for obj in self.objects.values():  # a wrapper's inner optimizer (ZeroRedundancyOptimizer's)
            if isinstance(obj, torch.optim.Optimizer):
                saved.update(
                    id(inner)
                    for inner in (getattr(obj, "optim", None), getattr(obj, "optimizer", None))
                    if inner is not None
                )
        checked: set[int] = set()

        def pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if id(optimizer) in checked:
                return
            if id(optimizer) not in saved and _over(optimizer, params):
                raise UnsavedStateError(
                    f"an optimizer ({type(optimizer).__name__}) over the model's parameters steps but is not part of "
                    f"the saved state (saved: {', '.join(sorted(self.objects))}): after a heal or a resume it would "
                    "differ between ranks; create it before Elastic(...) (or the loop), or pass it with states={...}"
                )
            checked.add(id(optimizer))

        handle = register_optimizer_step_pre_hook(pre_step)
        try:
            yield
        finally:
            handle.remove()

    def checksums(self) -> list[tuple[str, int]]:
        """One exact checksum per saved object (of its ``state_dict()`` tensors' bytes) that every
        rank holds alike: a sharded model's and optimizers' shards differ between ranks by design."""
        own = self.sharded.owns if self.sharded is not None else frozenset()
        return [
            (name, state_checksum(obj.state_dict()))
            for name, obj in self.objects.items()
            if obj is not None and name != "sampler" and name not in own
        ] + [("step", self.step)]

    def verify_replicas(self, group: Any = None) -> None:
        """Collective (one allreduce of two integers per object): every rank holds the same state.

        Raises:
            ReplicaMismatchError: naming the first object that differs.
        """
        if self.env.world_size <= 1:
            return
        named = self.checksums()
        device = (
            self.env.device if self.env.backend == "nccl" else torch.device("cpu")
        )  # NCCL reduces on the GPU
        values = torch.tensor(
            [c for _, c in named] + [-c for _, c in named], dtype=torch.int64, device=device
        )
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        n = len(named)
        for i, (name, _) in enumerate(named):
            if int(values[i]) != -int(values[n + i]):
                self.guard.consistent = False  # nothing of it may be saved
                raise ReplicaMismatchError(
                    f"after the heal the ranks hold different {name!r} states (its load_state_dict does not restore "
                    "everything its state_dict saves); falling back to the newest checkpoint"
                )
        log.debug("heal: %d states equal on every rank", len(named))


_MASK = (1 << 61) - 1
_PERIOD = 1021
"""Word ``i`` of a tensor weighs ``(i + 1) % _PERIOD + 1`` in :func:`state_checksum`."""
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weighted_sum(words: torch.Tensor) -> int:
    """``sum(words[i] * ((i + 1) % 1021 + 1))`` in int64 (wrapping), from one period of the
    weights per device: building ``arange(n) % 1021`` for every tensor was 80 % of a replica
    check (benchmarks/replica_check_cost.py)."""
    weights = _WEIGHTS.get(words.device)
    if weights is None:
        weights = torch.arange(1, _PERIOD + 1, dtype=torch.int64, device=words.device)
        weights = _WEIGHTS.setdefault(words.device, weights % _PERIOD + 1)
    n = words.numel()
    whole = n - n % _PERIOD
    total = (words[whole:] * weights[: n - whole]).sum()
    if whole:  # each column's words share a weight: sum them first (exact in int64 too)
        total = total + (words[:whole].view(-1, _PERIOD).sum(0) * weights).sum()
    return int(total)


def state_checksum(value: Any) -> int:
    """Exact, order-sensitive checksum of every tensor (bytes) and scalar in ``value``."""
    total = 0
    if isinstance(value, torch.Tensor):
        flat = value.detach().contiguous().reshape(-1)
        data = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
        if data.numel() % 8 == 0 and data.numel():
            words = data.view(torch.int64)
        else:
            words = data.to(torch.int64)
        return (_weighted_sum(words) + words.numel()) & _MASK
    if isinstance(value, Mapping):
        for i, (key, item) in enumerate(value.items()):
            total = (total * 31 + (i + 1) * state_checksum(item) + state_checksum(key)) & _MASK
        return total
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            total = (total * 31 + (i + 1) * state_checksum(item)) & _MASK
        return total
    if isinstance(value, (bool, int)):
        return int(value) & _MASK
    if isinstance(value, float):
        return int.from_bytes(struct.pack("<d", value), "little") & _MASK
    if isinstance(value, str):
        return zlib.crc32(value.encode())
    return zlib.crc32(repr(type(value)).encode())
