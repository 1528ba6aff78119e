"""elastic-trainer: fault-tolerant, elastic PyTorch training (DDP, FSDP2, HSDP).

The public API, importable from here (lazily: ``import elastic_trainer`` loads no torch), by
route:

- **The Trainer** (the runtime's loop): ``Trainer`` runs a ``TrainingJob`` (model, data, loss,
  optimizer factories) under a ``TrainerConfig`` (with ``CheckpointConfig``, ``DDPOptions``,
  ``FSDPOptions``) and returns a ``TrainResult``.
- **Your own loop**: ``Elastic`` around it yields each ``Step`` (its ``MicroBatch`` es); the
  run's settings are a ``RunConfig`` or its fields as keyword arguments. A model you shard
  yourself (``apply_fsdp``) is built inside ``ElasticGroup`` (the process group, healed in place)
  with ``NeighbourCopyConfig`` for its shards' copies. ``exit_process(code)`` ends a worker script
  without torch's C++ teardown, which can abort a finished gloo worker.
- **The parts below them**: ``ElasticLoop`` (the steps), ``CheckpointManager`` (a
  ``TrainingState`` to and from disk), ``TrainingState`` (what is saved, restored and handed to a
  peer; ``find_states`` finds the optimizers and schedulers), ``ElasticSampler`` (the data order).

Packages, by the process that runs them: ``runtime``, ``state``, ``train``, ``heal``,
``checkpoint`` and ``metrics`` (worker processes), ``launch`` (the launcher of ``elastic-trainer
run``), ``ops`` (operator tools: status, top, demo), ``doctor``, ``examples``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # The Trainer
    "Trainer": "elastic_trainer.train.trainer",
    "TrainingJob": "elastic_trainer.train.trainer",
    "TrainerConfig": "elastic_trainer.train.config",
    "CheckpointConfig": "elastic_trainer.checkpoint.config",
    "DDPOptions": "elastic_trainer.train.config",
    "FSDPOptions": "elastic_trainer.train.config",
    "TrainResult": "elastic_trainer.train.loop",
    # Your own loop
    "Elastic": "elastic_trainer.train.elastic",
    "Step": "elastic_trainer.train.elastic",
    "MicroBatch": "elastic_trainer.runtime.sampler",
    "RunConfig": "elastic_trainer.train.config",
    "ElasticGroup": "elastic_trainer.train.elastic_group",
    "apply_fsdp": "elastic_trainer.train.fsdp",
    "NeighbourCopyConfig": "elastic_trainer.state.neighbour_copy",
    "exit_process": "elastic_trainer.runtime.process_exit",
    # The parts below them
    "ElasticLoop": "elastic_trainer.train.loop",
    "CheckpointManager": "elastic_trainer.checkpoint.manager",
    "TrainingState": "elastic_trainer.state.training_state",
    "find_states": "elastic_trainer.state.training_state",
    "ElasticSampler": "elastic_trainer.runtime.sampler",
}
__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
