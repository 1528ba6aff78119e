"""Operator tools: ``elastic-trainer status``, ``top`` and ``demo``.

Runs in: the operator's shell, on any machine that reaches etcd or the nodes' metrics endpoints.
"""
