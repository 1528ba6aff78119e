"""``elastic-trainer run``: the launcher process of one node.

Runs in: the launcher (one per node), around torchrun's own agent: options, the embedded etcd, the
warm-start server, the node's metrics endpoint, the failure policy, the progress publisher and
the janitor that cleans up after it. Design: ``docs/design/launcher.md``.
"""
