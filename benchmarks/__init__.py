"""Benchmarks: each module measures one claim; the numbers and their commands are in RESULTS.md.

Run them from the repository root as modules, ``python -m benchmarks.NAME --help``, so that
``benchmarks.workloads`` and the ``elastic_trainer`` and ``rendezvous`` packages import without
any ``sys.path`` change. Nodes are driven with :mod:`elastic_trainer.ops.processes`; nothing here
imports ``tests``.
"""
