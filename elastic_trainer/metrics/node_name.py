"""The one name of a node (one launcher and its torchrun agent): ``{short host}-{agent pid}``.

The ``node`` label of every metric, the name ``elastic-trainer status`` and ``top`` show. Both
halves come from what the lease rendezvous stores per node (``rendezvous.lease_handler.NodeInfo``:
``addr``, ``pid``; under ``elastic-trainer run`` the agent's pid is the launcher's). Stable across
worker restarts; exported to workers as ``ELASTIC_TRAINER_NODE``. Why: ``docs/design/metrics.md``.
"""

from __future__ import annotations

import ipaddress
import os
import socket


def short_host(addr: str) -> str:
    """The first label of a host name (``node-3.cluster.local`` -> ``node-3``); an IP address whole."""
    addr = addr.strip().strip("[]")
    if not addr:
        return "unknown"
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return addr.split(".", 1)[0] or addr
    return addr


def node_name(addr: str, pid: int | None) -> str:
    """The name of the node whose agent runs as ``pid`` on ``addr`` (no pid: the short host only)."""
    return short_host(addr) if pid is None else f"{short_host(addr)}-{pid}"


def local_node_name(pid: int | None = None) -> str:
    """This host's node name for an agent running as ``pid`` (default: this process).

    Uses ``socket.getfqdn()``, as the lease rendezvous does when torchrun has no ``--local-addr``.
    """
    return node_name(socket.getfqdn(), os.getpid() if pid is None else pid)


def worker_node_name(from_launcher: str | None) -> str:
    """The node name a worker reports: the launcher's (``ELASTIC_TRAINER_NODE``), else the short
    host name (a worker started without ``elastic-trainer run`` does not know its agent's pid)."""
    return from_launcher or short_host(socket.gethostname())
