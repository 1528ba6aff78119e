"""``elastic-trainer status``: what the rendezvous of a run looks like in etcd right now.

    elastic-trainer status --rdzv-endpoint etcd:2379 --run-id job1 --checkpoint-dir /ckpt --json

The state is the one torch's dynamic rendezvous handler keeps (a pickled ``_RendezvousState``).
It is read with an unpickler that admits only the classes that state is made of, so a tampered
key cannot run code in the operator's shell.
"""

from __future__ import annotations

import io
import pickle
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from elastic_trainer.launch_options import UserError

_ALLOWED_CLASSES = {
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timedelta"),
    ("datetime", "timezone"),
    ("builtins", "set"),
    ("builtins", "dict"),
}


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_CLASSES:
            raise pickle.UnpicklingError(f"unexpected class {module}.{name} in rendezvous state")
        return super().find_class(module, name)


def decode_state(raw: bytes) -> Any:
    """Unpickle a rendezvous state, admitting only its own classes."""
    return _StateUnpickler(io.BytesIO(raw)).load()


def _node(node: Any) -> dict[str, Any]:
    return {"node": f"{node.addr}_{node.pid}_{node.local_id}", "addr": node.addr, "pid": node.pid}


def describe_state(state: Any, now: datetime) -> dict[str, Any]:
    """A JSON-ready view of a ``_RendezvousState`` (``now``: an aware UTC datetime)."""
    heartbeats = state.last_heartbeats
    participants = []
    for node, rank in sorted(state.participants.items(), key=lambda item: item[1]):
        beat = heartbeats.get(node)
        if beat is not None and beat.tzinfo is None:  # older torch wrote naive UTC times
            beat = beat.replace(tzinfo=timezone.utc)
        participants.append(
            {**_node(node), "rank": rank,
             "heartbeat_age_s": None if beat is None else round((now - beat).total_seconds(), 1)}
        )
    return {
        "handler": "dynamic",
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "participants": participants,
        "waiting": [_node(n) for n in sorted(state.wait_list, key=str)],
        "redundant": [_node(n) for n in sorted(state.redundancy_list, key=str)],
    }


def _lease_node(node: str) -> dict[str, Any]:
    """Node ids of the lease handler are ``ADDR_PID_SUFFIX``."""
    parts = node.rsplit("_", 2)
    addr = parts[0] if len(parts) == 3 else node
    pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
    return {"node": node, "addr": addr, "pid": pid}


def describe_lease_state(snapshot: Any, lease_ages: dict[str, float | None]) -> dict[str, Any]:
    """A JSON-ready view of the lease handler's state (``rendezvous.lease_handler``)."""
    state = snapshot.state
    participants = [
        {**_lease_node(node), "rank": rank, "alive": node in snapshot.live,
         "heartbeat_age_s": lease_ages.get(node)}
        for rank, node in enumerate(state.participants)
    ]
    in_round = set(state.participants)
    waiting = [n for n in snapshot.joined.get(state.round, []) if n not in in_round]
    waiting += [n for n in sorted(snapshot.live) if n not in in_round and n not in waiting]
    return {
        "handler": "lease",
        "round": state.round,
        "complete": state.status == "complete",
        "closed": state.status == "closed",
        "participants": participants,
        "waiting": [_lease_node(n) for n in waiting],
        "redundant": [],
    }


def _read_lease_status(params: Any, run_id: str) -> dict[str, Any] | None:
    from rendezvous.etcd_backend import DEFAULT_KEY_PREFIX, client_config_from_params
    from rendezvous.etcd_client import EtcdConnection
    from rendezvous.lease_handler import RunKeys, read_snapshot

    connection = EtcdConnection(client_config_from_params(params))
    try:
        snapshot = read_snapshot(connection, RunKeys(str(params.get("key_prefix", DEFAULT_KEY_PREFIX)), run_id))
        if snapshot.state is None:
            return None
        ages: dict[str, float | None] = {}
        def lease_info(lease_id: int) -> Any:
            return connection.call(lambda client: client.get_lease_info(lease_id), what="a lease read")

        for node, lease_id in snapshot.leases.items():
            info = lease_info(lease_id)
            # keep-alives run every TTL/3, so the time since the last one is granted - remaining
            ages[node] = float(info.grantedTTL - info.TTL) if info.TTL > 0 else None
        return describe_lease_state(snapshot, ages)
    finally:
        connection.close()


def newest_checkpoint(directory: str) -> dict[str, Any] | None:
    from elastic_trainer.checkpoint import find_latest

    path = Path(directory)
    if not path.is_dir():
        raise UserError(f"--checkpoint-dir {directory}: not a directory")
    info = find_latest(path)
    if info is None:
        return None
    created = datetime.fromtimestamp(info.manifest.created_unix, timezone.utc)
    return {
        "path": str(info.path),
        "step": info.step,
        "epoch": info.manifest.epoch,
        "age_s": round((datetime.now(timezone.utc) - created).total_seconds(), 1),
    }


def read_status(endpoint: str, run_id: str, rdzv_conf: dict[str, str], checkpoint_dir: str | None) -> dict[str, Any]:
    """Everything ``status`` shows, as a dict.

    Raises:
        UserError: bad endpoint or settings, unreachable etcd, unreadable state.
    """
    from torch.distributed.elastic.rendezvous import (
        RendezvousConnectionError,
        RendezvousParameters,
        RendezvousStateError,
    )

    from rendezvous.etcd_backend import create_backend
    from rendezvous.etcd_client import quiet_retries

    params = RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, **rdzv_conf)
    try:
        with quiet_retries():
            backend, _ = create_backend(params)
            lease_view = _read_lease_status(params, run_id)
            found = None if lease_view is not None else backend.get_state()
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    except (RendezvousConnectionError, RendezvousStateError) as exc:
        raise UserError(f"cannot read the rendezvous of {run_id!r}: {exc}") from exc
    report: dict[str, Any] = {"run_id": run_id, "endpoint": endpoint,
                              "found": found is not None or lease_view is not None}
    if lease_view is not None:
        report.update(lease_view)
    elif found is not None:
        try:
            state = decode_state(found[0])
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise UserError(f"the rendezvous state of {run_id!r} is unreadable: {exc}") from exc
        report.update(describe_state(state, datetime.now(timezone.utc)))
    if checkpoint_dir is not None:
        report["checkpoint"] = newest_checkpoint(checkpoint_dir)
    return report


def render_status(report: dict[str, Any]) -> str:
    """Human-readable lines of a status report."""
    lines = [f"run {report['run_id']} on etcd {report['endpoint']}"]
    if not report["found"]:
        lines.append("  no rendezvous state (the run has not started, or its state expired)")
    else:
        flags = ("closed" if report["closed"] else "open") + (", complete" if report["complete"] else ", forming")
        lines.append(f"  round {report['round']} ({flags}), {len(report['participants'])} participant(s)")
        for p in report["participants"]:
            age = "?" if p["heartbeat_age_s"] is None else f"{p['heartbeat_age_s']}s"
            lines.append(f"    rank {p['rank']:>3}  {p['node']:<40} heartbeat {age} ago")
        lines.append(f"  waiting: {', '.join(n['node'] for n in report['waiting']) or 'none'}")
        if report["redundant"]:
            lines.append(f"  redundant: {', '.join(n['node'] for n in report['redundant'])}")
    if "checkpoint" in report:
        ckpt = report["checkpoint"]
        lines.append(
            "  newest checkpoint: none" if ckpt is None
            else f"  newest checkpoint: step {ckpt['step']} (epoch {ckpt['epoch']}), {ckpt['age_s']}s old, {ckpt['path']}"
        )
    return "\n".join(lines)
