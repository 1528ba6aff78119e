"""Training metrics on the worker side, and the progress arithmetic shared by the operator tools.

Runs in: the worker processes (``worker``: the Prometheus observer; ``ddp_stats``,
``bucket_trace``, ``collective_trace``: allreduce timing, none of them a comm hook). ``progress`` and ``node_name`` are pure
and shared; ``prometheus_compat`` holds every private prometheus-client use (workers and the
launcher). The node's endpoint and the agent's metrics are the launcher's
(``elastic_trainer.launch.node_metrics``, ``elastic_trainer.launch.agent_metrics``). Design:
``docs/design/metrics.md``.
"""
