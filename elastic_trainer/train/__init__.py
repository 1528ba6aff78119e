"""The training loop and the worker entry point.

Runs in: every worker process. :class:`~elastic_trainer.train.trainer.Trainer` runs a
:class:`~elastic_trainer.train.trainer.TrainingJob` on the public pieces of ``runtime``,
``checkpoint`` and ``metrics``; :mod:`~elastic_trainer.train.elastic_group` owns the process
group over a run and heals it in place (for the Trainer and own loops alike);
:mod:`~elastic_trainer.train.worker_entry` is what torchrun starts under ``elastic-trainer run``.
"""
