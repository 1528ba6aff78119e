"""Checks of the state an own loop keeps: the traps that make a resume silently inexact.

``states=`` objects are saved once, from rank 0, and restored on every rank, so a per-rank object
(a generator seeded from the rank, a tracker of this rank's loss) comes back as rank 0's copy after
any fault. :func:`differing_states` finds them (one tiny allreduce of per-object checksums after
the first step of each attempt); :func:`unsaved_objects` finds stateful objects of the loop's
frame that are not saved at all (a ``torch.Generator``, anything with ``state_dict`` and
``load_state_dict`` that is not registered), and :class:`UnsavedWatch` keeps those whose state
then changes in training (one used only to build the data, or a frozen teacher, is no divergence
risk). Both end in one warning line from rank 0, never an error: a run may accept either on
purpose, and names it in ``Elastic(ignore_states=...)``.
:func:`finished_message` is the line for a resume at or past the end. Docs: ``docs/own-loop.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from types import FunctionType, ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from elastic_trainer.runtime.abortable import AbortableWaits
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.state.training_state import state_checksum

SMALL_STATE_BYTES = 1 << 20
"""Tensor bytes above which a ``states`` object is not checksummed for per-rank differences (a
large one, an EMA of the model, is derived from the replicated model anyway)."""

DERIVE_HINT = (
    "torch's default generator is reseeded per (seed, rank, step) at every step: draw from it, or "
    "reseed your own at the step's start with `gen.manual_seed(torch.initial_seed() + 1)`, and "
    "keep per-rank counters out of `states` (or reduce them over the ranks first)"
)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def small_checksums(objects: Mapping[str, Any]) -> list[tuple[str, int]]:
    """A checksum of each object's ``state_dict()`` whose tensors hold at most
    :data:`SMALL_STATE_BYTES` (optimizers, schedulers, scalers and modules are skipped: they are
    replicated by DDP, and the heal's own check covers them)."""
    out = []
    for name, obj in objects.items():
        if obj is None or isinstance(
            obj,
            (nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler),
        ):
            continue
        if type(obj).__name__ == "GradScaler":
            continue
        state = obj.state_dict()
        if _tensor_bytes(state) <= SMALL_STATE_BYTES:
            out.append((name, state_checksum(state)))
    return out


def differing_states(
    objects: Mapping[str, Any],
    env: DistEnv,
    group: Any = None,
    *,
    waits: AbortableWaits | None = None,
) -> list[str]:
    """Collective (one allreduce of two integers per small object): the names of ``objects``
    whose state differs between the ranks. Every rank must call it at the same point. ``waits``:
    the healer's, so that a heal's abort ends the wait at once (``runtime/abortable.py``)."""
    if env.world_size <= 1:
        return []
    named = small_checksums(objects)
    if not named:
        return []
    device = env.device if env.backend == "nccl" else torch.device("cpu")
    values = torch.tensor(
        [c for _, c in named] + [-c for _, c in named], dtype=torch.int64, device=device
    )
    work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group, async_op=True)
    if waits is not None and waits.enabled:
        waits.track(work.get_future()).wait()  # type: ignore[union-attr]
    else:
        work.wait()  # type: ignore[union-attr]
    n = len(named)
    return [name for i, (name, _) in enumerate(named) if int(values[i]) != -int(values[n + i])]


def per_rank_message(names: Iterable[str]) -> str:
    listed = ", ".join(repr(n) for n in names)
    return (
        f"states {listed} differ between the ranks: states are saved from rank 0 and restored on "
        "every rank, so after a heal or restart every rank gets rank 0's copy and training is no "
        f"longer the fault-free run's; {DERIVE_HINT} (docs/own-loop.md, 'Per-rank state'; "
        "silence with Elastic(ignore_states=...))"
    )


def _stateful(obj: object) -> bool:
    if isinstance(obj, torch.Generator):
        return True
    if isinstance(obj, (type, ModuleType, FunctionType)):
        return False
    kind = type(obj)
    if kind.__module__.startswith("elastic_trainer."):
        return False  # the library's own objects (the state, the sampler) are handled
    if not (
        callable(getattr(kind, "state_dict", None))
        and callable(getattr(kind, "load_state_dict", None))
    ):
        return False
    if isinstance(obj, nn.Module):  # a loss module: nothing to save
        return any(True for _ in obj.parameters()) or any(True for _ in obj.buffers())
    return True


def unsaved_objects(
    namespace: Mapping[str, Any],
    registered: Iterable[Any],
    *,
    model: nn.Module | None = None,
    ignore: Collection[str] = (),
) -> list[str]:
    """The names in ``namespace`` (a frame's locals and globals) bound to a stateful object that
    is not saved: a ``torch.Generator`` or an object with ``state_dict`` and ``load_state_dict``
    that is neither registered, nor held by a registered object (a wrapper's attribute), nor part
    of ``model``, nor a module with no parameters and no buffers. Pure; cheap (one pass)."""
    covered: set[int] = set()
    for obj in registered:
        if obj is None:
            continue
        covered.add(id(obj))
        covered.update(id(v) for v in getattr(obj, "__dict__", {}).values())
    if model is not None:
        covered.update(id(m) for m in model.modules())
    names = []
    for name, obj in namespace.items():
        if name.startswith("__") or name in ignore or id(obj) in covered:
            continue
        if _stateful(obj):
            names.append(name)
            covered.add(id(obj))  # the same object under two names: once
    return names


CHANGE_WINDOW_STEPS = 3
"""Steps of a job start after which :class:`UnsavedWatch` compares the unsaved objects with their
state at the start (or the run's end, when it trains fewer)."""

_SAMPLE = 64
"""Elements of each tensor a large state's fingerprint reads (with the tensor's version)."""


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to each tensor in its dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_tensors(v, fn) for v in value]
    return value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor: the watch runs on rank 0 alone, where a DTensor's reshape
    could start a collective."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sampled(tensor: torch.Tensor) -> Any:
    head = tensor.detach().view(-1)[:_SAMPLE] if tensor.is_contiguous() else None
    return (tensor._version, head if head is not None else tensor.shape)


def state_fingerprint(obj: Any) -> int:
    """A checksum of what ``obj`` holds (a generator's state, else its ``state_dict()``): every
    byte of a state up to :data:`SMALL_STATE_BYTES`; for a larger one (a frozen teacher model)
    each tensor's in-place version counter and first elements, so that watching it copies
    nothing large."""
    state = (
        obj.get_state()
        if isinstance(obj, torch.Generator)
        else _map_tensors(obj.state_dict(), _local)
    )
    if _tensor_bytes(state) <= SMALL_STATE_BYTES:
        return state_checksum(state)
    return state_checksum(_map_tensors(state, _sampled))


class UnsavedWatch:
    """The unsaved stateful objects (:func:`unsaved_objects`) of a job start, and a fingerprint of
    each: :meth:`moved` names those whose state changed since. Only they are a divergence risk
    after a restart; a generator used to build the data before training, or a frozen model, is
    not. An object whose state cannot be read counts as changed (named, as before the watch)."""

    def __init__(self, objects: Mapping[str, Any]) -> None:
        self._objects = dict(objects)
        self._before = {name: self._read(obj) for name, obj in self._objects.items()}

    @staticmethod
    def _read(obj: Any) -> int | None:
        try:
            return state_fingerprint(obj)
        except Exception:  # noqa: BLE001 - an advisory check; the object is named instead
            return None

    def moved(self) -> dict[str, Any]:
        """The objects (by name) whose state changed since the watch began; the watch then lets
        go of them all (it answers once)."""
        objects, self._objects = self._objects, {}
        moved = {}
        for name, obj in objects.items():
            before = self._before.get(name)
            if before is None or self._read(obj) != before:
                moved[name] = obj
        self._before = {}
        return moved


RATE_JUMP = 2.0
"""Factor between the learning rate restored at an attempt's start and the one its first update
used beyond which :class:`ScheduleWatch` speaks (a smooth schedule moves far less in one step)."""


def hand_set_rates(objects: Iterable[Any]) -> list[float]:
    """The learning rate of each param group of the optimizers among ``objects`` that no LR
    scheduler among them drives (a rate the loop writes itself)."""
    objects = list(objects)
    driven = {
        id(getattr(obj, "optimizer", None))
        for obj in objects
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler)
    }
    rates: list[float] = []
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer) and id(obj) not in driven:
            rates.extend(float(group["lr"]) for group in obj.param_groups if "lr" in group)
    return rates


def loop_ints(namespace: Mapping[str, Any]) -> dict[str, int]:
    """The loop frame's integer variables (its counters among them)."""
    return {k: v for k, v in namespace.items() if type(v) is int and not k.startswith("_")}


class ScheduleWatch:
    """A schedule the loop computes from a counter of its own: after a resume or a heal the counter
    starts over while the run goes on from its step, so the rate the loop writes into the
    optimizer jumps away from the restored one (back to the warm-up's start, typically), and after
    a heal the replicas' rates differ. Taken at the start of an attempt from a restored state;
    :meth:`message` compares the rates of its first update and names the loop's integers that
    counted that step yet stand below the run's step."""

    def __init__(self, rates: list[float], ints: Mapping[str, int], step: int) -> None:
        self._rates, self._ints, self._step = rates, dict(ints), step

    def message(self, rates: list[float], ints: Mapping[str, int]) -> str | None:
        """The warning (one line), or ``None`` when every rate moved by less than
        :data:`RATE_JUMP`."""
        if len(rates) != len(self._rates):
            return None
        jumps = [
            (before, after)
            for before, after in zip(self._rates, rates, strict=True)
            if min(before, after) <= 0 < max(before, after)
            or (min(before, after) > 0 and max(before, after) / min(before, after) >= RATE_JUMP)
        ]
        if not jumps:
            return None
        before, after = jumps[0]
        counters = sorted(
            name for name, value in ints.items() if self._ints.get(name) == value - 1 < self._step
        )
        likely = f" (likely {' or '.join(counters)})" if counters else ""
        return (
            f"the learning rate went from {before:.3g}, restored at step {self._step}, to "
            f"{after:.3g} at step {self._step + 1}: a schedule computed from a counter of the "
            f"loop's own{likely} starts over at every resume and heal while the run goes on, and "
            "replicas disagree after a heal; compute it from step.number (docs/own-loop.md)"
        )


def unsaved_message(objects: Mapping[str, Any], *, rebuilt: bool = False) -> str:
    """The warning (one short line) for unsaved objects whose state changed in training, by name;
    ``rebuilt``: the run has ``rebuild=`` (a model sharded by the user), whose objects are built
    there and returned by name."""
    listed = ", ".join(f"{name} ({type(obj).__name__})" for name, obj in objects.items())
    generators = [name for name, obj in objects.items() if isinstance(obj, torch.Generator)]
    scalers = [name for name, obj in objects.items() if type(obj).__name__ == "GradScaler"]
    others = [name for name in objects if name not in generators and name not in scalers]
    fixes = []
    if scalers:
        fixes.append(f"Elastic(..., scaler={scalers[0]})")
    if others and rebuilt:
        fixes.append("build them in your rebuild= function and return them by name")
    elif others:
        fixes.append("states={" + ", ".join(f"'{n}': {n}" for n in others) + "}")
    if generators:
        fixes.append(f"{generators[0]}.manual_seed(torch.initial_seed() + 1) each step")
    return (
        f"not saved, yet changed in training: {listed}; a restart starts them over. Fix: "
        f"{'; '.join(fixes)} (docs/own-loop.md; or ignore_states=)"
    )


def finished_message(path: str | None, step: int, *, max_steps: int | None) -> str:
    """The line for a resume that leaves nothing to train (a finished job, or ``max_steps``
    below the checkpoint's step)."""
    bound = f"max_steps={max_steps}" if max_steps is not None and step >= max_steps else "epochs"
    where = path if path is not None else "the checkpoint"
    return (
        f"nothing to train: resumed {where} is at step {step}, at or past {bound}, so the run ends "
        "at once; to start afresh, give another checkpoint directory (--checkpoint-dir / "
        "checkpoint_dir=) or delete this one's checkpoints"
    )
