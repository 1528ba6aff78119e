"""The one name of a node (one launcher and its torchrun agent): ``{short host}-{agent pid}``.

Metrics label their series with it (``node``), ``elastic-trainer status`` shows it next to the
rendezvous node id, and ``elastic-trainer top`` names the slowest node with it, so an operator
can follow one node from a dashboard to ``status`` and back. Two nodes on one host differ by
their pid; a node keeps its name across worker restarts (the agent lives on).

Both halves come from what the lease rendezvous already stores for each node under
``rdzv/nodes/<node id>`` (``{"addr": ..., "pid": ...}``, ``rendezvous.lease_handler.NodeInfo``):
``addr`` is the host's fully qualified name unless torchrun got ``--local-addr``, and ``pid`` is
the agent's, which under ``elastic-trainer run`` is the launcher's own pid.

The launcher exports the name to its workers as ``ELASTIC_TRAINER_NODE``.
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
