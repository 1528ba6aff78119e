"""Objects kept across a rebuild that still point at an object the rebuild replaced.

After an in-place heal of a sharded state, ``rebuild`` returns a model and optimizers built on the
new group, and :meth:`TrainingState.replace` swaps them in by name. An object ``rebuild`` did not
return (a scheduler built once, outside ``build()``) still holds the old optimizer: it would set
the learning rate of an optimizer nothing steps any more, and the run would drift from a
fault-free one without a word. So:

- a kept learning-rate scheduler (``LRScheduler``, ``ReduceLROnPlateau``, and each scheduler inside
  ``SequentialLR``/``ChainedScheduler``) is pointed at the optimizer that replaced its own, under
  the same name: its state (epoch, base rates) is what it was, so it sets the rates it would have
  set on a scheduler built on the new optimizer and loaded from the same state;
- a kept optimizer that steps parameters of a replaced model is refused in one line: it would
  step a model nothing trains any more, and its state could not be restored into the new one;
- any other kept object with an attribute that is a replaced object is named in one warning;
- each such object is named once per process, with the fix: return it from ``rebuild``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from elastic_trainer.runtime.failures import ConfigError

log = logging.getLogger(__name__)

_warned: set[str] = set()
"""Names already warned about in this process (a warning a heal would repeat says nothing new)."""


def follow_rebuild(
    objects: Mapping[str, Any], replaced: Mapping[str, Any], returned: Mapping[str, Any]
) -> list[str]:
    """Point the kept ``objects`` (names ``returned`` lacks) at the objects that replaced
    ``replaced`` (name -> the object before the rebuild); ``returned``: name -> the new object.

    Returns the names of the kept objects that held a replaced object.

    Raises:
        ConfigError: a kept scheduler's optimizer was replaced by something that is no optimizer,
            or a kept optimizer steps the parameters of a replaced model.
    """
    by_id = {id(old): name for name, old in replaced.items() if old is not None}
    old_parameters = {
        id(p): name
        for name, old in replaced.items()
        if isinstance(old, nn.Module)
        for p in old.parameters()
    }
    found: list[str] = []
    for name, obj in objects.items():
        if name in returned or obj is None:
            continue
        if isinstance(obj, Optimizer):
            _refuse_stale_optimizer(name, obj, old_parameters)
        elif isinstance(obj, (LRScheduler, ReduceLROnPlateau)):
            rebound = _rebind_scheduler(name, obj, by_id, returned)
            if rebound:
                found.append(name)
                _warn_once(
                    name,
                    f"{name!r} was built on the optimizer {rebound!r} that rebuild replaced after "
                    f"the heal; it now drives the rebuilt one. Return {name!r} from rebuild "
                    "(your build()) too, built on the new optimizer",
                )
        elif held := [
            f"{attr} ({by_id[id(value)]!r})"
            for attr, value in _attributes(obj)
            if id(value) in by_id
        ]:
            found.append(name)
            _warn_once(
                name,
                f"{name!r} still holds {', '.join(held)} of the attempt before the heal, which "
                f"rebuild replaced: it keeps working on the old object. Return {name!r} from "
                "rebuild (your build()) too",
            )
    return found


def _refuse_stale_optimizer(
    name: str, optimizer: Optimizer, old_parameters: Mapping[int, str]
) -> None:
    """A kept optimizer that steps a replaced model's parameters is an error (it would train the
    old model)."""
    stepped = {
        old_parameters[id(p)]
        for group in optimizer.param_groups
        for p in group["params"]
        if id(p) in old_parameters
    }
    if stepped:
        raise ConfigError(
            f"rebuild did not return {name!r}, which steps the parameters of "
            f"{', '.join(repr(m) for m in sorted(stepped))} that it replaced after the "
            f"heal: build {name!r} in rebuild (your build()) and return it under that "
            "name (docs/own-loop.md, 'A model you shard yourself')"
        )


def _rebind_scheduler(
    name: str, scheduler: Any, by_id: Mapping[int, str], returned: Mapping[str, Any]
) -> str | None:
    """Point ``scheduler`` (and the schedulers it chains) at the rebuilt optimizer; the name of
    the optimizer it followed, or ``None`` when its optimizer was not replaced."""
    followed: str | None = None
    for part in [scheduler, *getattr(scheduler, "_schedulers", [])]:
        old_name = by_id.get(id(getattr(part, "optimizer", None)))
        if old_name is None:
            continue
        new = returned[old_name]
        if not isinstance(new, Optimizer):
            raise ConfigError(
                f"{name!r} schedules {old_name!r}, which rebuild replaced with "
                f"{type(new).__name__}, not an optimizer: return {name!r} from rebuild too"
            )
        part.optimizer = new
        followed = old_name
    return followed


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    try:
        return list(vars(obj).items())
    except TypeError:  # no __dict__ (slots, builtins): nothing of ours to see
        return []


def _warn_once(name: str, text: str) -> None:
    if name in _warned:
        return
    _warned.add(name)
    log.warning("%s", text)
