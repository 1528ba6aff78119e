"""Who is who in a local etcd cluster, asked through etcd's JSON gateway (not through the code
under test): each member's id and the leader it names."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence

from rendezvous.etcd_server import EtcdServer


def etcd_status(endpoint: str) -> dict[str, str]:
    """``member_id`` and ``leader`` of the member at ``endpoint`` (etcd's JSON gateway)."""
    request = urllib.request.Request(
        f"http://{endpoint}/v3/maintenance/status", data=b"{}", method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        status = json.loads(response.read())
    return {"member_id": status["header"]["member_id"], "leader": status["leader"]}


def leader_first(servers: Sequence[EtcdServer]) -> list[EtcdServer]:
    """The members of a cluster with the current leader first (the one clients try first)."""
    leader = etcd_status(servers[0].endpoint)["leader"]
    ids = {etcd_status(s.endpoint)["member_id"]: s for s in servers}
    first = ids[leader]
    return [first, *[s for s in servers if s is not first]]
