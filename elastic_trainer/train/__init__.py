"""The training loop and the worker entry point.

Runs in: every worker process. :class:`~elastic_trainer.train.trainer.Trainer` runs a
:class:`~elastic_trainer.train.trainer.TrainingJob` on the public pieces of ``runtime``,
``checkpoint`` and ``metrics``; :mod:`~elastic_trainer.train.worker_entry` is what torchrun starts
under ``elastic-trainer run``.
"""
