"""elastic-trainer: fault-tolerant, elastic PyTorch DDP training.

The public API, importable from here (lazily: ``import elastic_trainer`` loads no torch)::

    from elastic_trainer import Trainer, TrainingJob, TrainerConfig, CheckpointConfig   # the runtime's loop
    from elastic_trainer import Elastic                                                  # your own loop

Below ``Elastic``, its parts are public too: ``ElasticGroup`` (the process group, healed in
place), ``ElasticLoop`` (the steps), ``CheckpointManager`` (disk), ``TrainingState`` (what is
saved, restored and handed to a peer), ``ElasticSampler`` (the data order). ``exit_process(code)``
ends a worker script without torch's C++ teardown, which can abort a finished gloo worker.

Packages, by the process that runs them: ``runtime``, ``state``, ``train``, ``heal``,
``checkpoint`` and ``metrics`` (worker processes), ``launch`` (the launcher of ``elastic-trainer run``), ``ops`` (operator tools:
status, top, demo), ``doctor``, ``examples``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Trainer": "elastic_trainer.train.trainer",
    "TrainingJob": "elastic_trainer.train.trainer",
    "TrainResult": "elastic_trainer.train.loop",
    "TrainerConfig": "elastic_trainer.train.config",
    "DDPOptions": "elastic_trainer.train.config",
    "ElasticLoop": "elastic_trainer.train.loop",
    "Elastic": "elastic_trainer.train.elastic",
    "Step": "elastic_trainer.train.elastic",
    "MicroBatch": "elastic_trainer.runtime.sampler",
    "ElasticGroup": "elastic_trainer.train.elastic_group",
    "TrainingState": "elastic_trainer.state.training_state",
    "find_states": "elastic_trainer.state.training_state",
    "CheckpointConfig": "elastic_trainer.checkpoint.config",
    "CheckpointManager": "elastic_trainer.checkpoint.manager",
    "ElasticSampler": "elastic_trainer.runtime.sampler",
    "WorkerSettings": "elastic_trainer.runtime.settings",
    "build_observer": "elastic_trainer.train.trainer",
    "model_signature": "elastic_trainer.checkpoint.files",
    "FSDPOptions": "elastic_trainer.train.config",
    "apply_fsdp": "elastic_trainer.train.fsdp",
    "NeighbourCopyConfig": "elastic_trainer.state.neighbour_copy",
    "exit_process": "elastic_trainer.runtime.process_exit",
}
__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
