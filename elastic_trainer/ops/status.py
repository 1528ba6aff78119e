"""``elastic-trainer status``: what the rendezvous of a run looks like in etcd right now.

    elastic-trainer status --rdzv-endpoint etcd:2379 --run-id job1 --checkpoint-dir /ckpt --json

Reads, over one etcd connection, the lease handler's state of the run
(:mod:`rendezvous.lease_handler`: JSON state, each node's address and pid from its node key, lease
ages as heartbeat ages). Nodes are shown by their metric name
(:mod:`elastic_trainer.metrics.node_name`); progress, ETA and the last error come from the keys
the launchers publish (:mod:`elastic_trainer.launch.progress_publisher`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)

from elastic_trainer.checkpoint.files import find_latest
from elastic_trainer.heal.membership import HealKeys
from elastic_trainer.heal.protocol import NO_STATE, Epoch, ProtocolError
from elastic_trainer.launch.options import UserError
from elastic_trainer.launch.progress_publisher import (
    ErrorRecord,
    ProgressKeys,
    ProgressRecord,
    read_progress,
)
from elastic_trainer.metrics.node_name import node_name
from elastic_trainer.metrics.progress import eta_seconds, format_duration
from rendezvous import etcd_ops
from rendezvous.etcd_client import EtcdConnection, quiet_retries
from rendezvous.lease_handler import NodeInfo, RunKeys, Snapshot, read_snapshot
from rendezvous.settings import RendezvousSettings, parse_settings


def _named(node: str, addr: str, pid: int | None) -> dict[str, Any]:
    """A node's id, metric name, address and pid."""
    return {"node": node, "name": node_name(addr, pid), "addr": addr, "pid": pid}


def _lease_node(node: str, value: bytes | None) -> dict[str, Any]:
    """``node`` with the address and pid its node key stores (``NodeInfo``).

    A node whose key is gone (its lease expired) or holds no valid value has only its id; the
    lease handler builds ids as ``ADDR_PID_SUFFIX``, so they are read from it as a best effort.
    """
    info = NodeInfo.decode(value)
    if info is not None:
        return _named(node, info.addr, info.pid)
    parts = node.rsplit("_", 2)
    addr = parts[0] if len(parts) == 3 else node
    pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
    return _named(node, addr, pid)


def describe_lease_state(snapshot: Snapshot, lease_ages: dict[str, float | None]) -> dict[str, Any]:
    """A JSON-ready view of the lease handler's state (``rendezvous.lease_handler``); its state must be set."""
    state = snapshot.state
    if state is None:
        raise ValueError("snapshot: the run has no lease rendezvous state")
    values = snapshot.node_values
    participants = [
        {
            **_lease_node(node, values.get(node)),
            "rank": rank,
            "alive": node in snapshot.live,
            "heartbeat_age_s": lease_ages.get(node),
        }
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
        "waiting": [_lease_node(n, values.get(n)) for n in waiting],
        "redundant": [],
    }


LEASE_READERS = 16
"""Lease reads ``status`` keeps in flight at once (each node's heartbeat age is one read)."""


def _read_lease_status(connection: EtcdConnection, keys: RunKeys) -> dict[str, Any] | None:
    """The lease handler's view of the run at ``keys``; ``None`` if it has no state there."""
    snapshot = read_snapshot(connection, keys)
    if snapshot.state is None:
        return None
    ages: dict[str, float | None] = {}

    def lease_info(lease_id: int) -> Any:
        return connection.call(lambda client: client.get_lease_info(lease_id), what="a lease read")

    # One read per node, LEASE_READERS at a time (a thousand nodes: a thousand round trips, which
    # one after another would take seconds); keep-alives run every TTL/3, so the time since the
    # last one is granted - remaining.
    with ThreadPoolExecutor(max_workers=LEASE_READERS, thread_name_prefix="status-lease") as pool:
        infos = pool.map(lease_info, snapshot.leases.values())
        for node, info in zip(snapshot.leases, infos, strict=True):
            ages[node] = float(info.grantedTTL - info.TTL) if info.TTL > 0 else None
    return describe_lease_state(snapshot, ages)


def newest_checkpoint(directory: str) -> dict[str, Any] | None:
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


def describe_progress(
    record: ProgressRecord | None, error: ErrorRecord | None, now_unix: float
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """JSON-ready views of the published progress and last error, with ages as of ``now_unix``
    and the ETA, (target - step) / steps per second."""
    progress = None
    if record is not None:

        def age(unix: float | None) -> float | None:
            return None if unix is None else round(max(0.0, now_unix - unix), 1)

        step, total = record.step, record.total_steps
        progress = {
            "step": step,
            "total_steps": total,
            "percent": None if step is None or not total else round(100.0 * step / total, 1),
            "eta_s": _rounded(eta_seconds(step, total, record.steps_per_s)),
            "world_size": record.world_size,
            "samples_per_s": _rounded(record.samples_per_s),
            "steps_per_s": _rounded(record.steps_per_s, 3),
            "step_time_p50_s": _rounded(record.step_time_p50_s, 4),
            "loss": record.loss,
            "lr": record.lr,
            "restarts": record.restarts,
            "heals": record.heals,
            "last_step_age_s": age(record.last_step_unix),
            "last_checkpoint_step": record.last_checkpoint_step,
            "last_checkpoint_age_s": age(record.last_checkpoint_unix),
            "published_by": record.node,
            "published_age_s": age(record.published_unix),
        }
    last_error = None
    if error is not None:
        last_error = {
            "text": error.text,
            "node": error.node,
            "age_s": round(max(0.0, now_unix - error.unix), 1),
        }
    return progress, last_error


def describe_heal_epoch(raw: bytes | None) -> dict[str, Any] | None:
    """A JSON-ready view of a job's in-place membership (``elastic_trainer.heal``): after its
    first rendezvous the members and their ranks are the workers' epochs, not the rendezvous
    round's (which stays as torch left it). ``None``: no epoch, or an unreadable one."""
    if raw is None:
        return None
    try:
        epoch = Epoch.decode(raw)
    except ProtocolError:
        return None
    members = []
    for rank, member in enumerate(epoch.members):
        node, _, local_rank = member.slot.rpartition("/")
        pid = member.id.split("/")[-1].split("-")[0]
        members.append(
            {
                "rank": rank,
                "node": node,
                "local_rank": int(local_rank) if local_rank.isdigit() else None,
                "pid": int(pid) if pid.isdigit() else None,
            }
        )
    return {
        "epoch": epoch.number,
        "finished": epoch.finished,
        "step": None if epoch.step == NO_STATE else epoch.step,
        "world_size": epoch.world_size,
        "reason": epoch.reason,
        "members": members,
    }


def _rounded(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


@contextlib.contextmanager
def run_connection(
    endpoint: str, run_id: str, rdzv_conf: dict[str, str]
) -> Iterator[tuple[RendezvousSettings, EtcdConnection]]:
    """The run's rendezvous settings and a connection to its etcd, closed on the way out, for
    ``status`` and ``debug``; retries stay quiet inside.

    Raises:
        UserError: bad endpoint or settings (one line), or etcd unreachable or its state unreadable
            inside the block.
    """
    params = RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, **rdzv_conf)
    try:
        settings = parse_settings(params)
        connection = EtcdConnection(settings.client_config())
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    try:
        with quiet_retries():
            yield settings, connection
    except (RendezvousConnectionError, RendezvousStateError, ValueError) as exc:
        raise UserError(f"cannot read the run {run_id!r}: {exc}") from exc
    finally:
        connection.close()


def read_status(
    endpoint: str, run_id: str, rdzv_conf: dict[str, str], checkpoint_dir: str | None
) -> dict[str, Any]:
    """Everything ``status`` shows, as a dict.

    Raises:
        UserError: bad endpoint or settings, unreachable etcd, unreadable state.
    """
    with run_connection(endpoint, run_id, rdzv_conf) as (settings, connection):
        lease_view = _read_lease_status(connection, RunKeys.from_settings(settings))
        record, error = read_progress(connection, ProgressKeys.from_settings(settings))
        heal = describe_heal_epoch(_read_heal_epoch(connection, run_id))
    report: dict[str, Any] = {
        "run_id": run_id,
        "endpoint": endpoint,
        "found": lease_view is not None,
    }
    if lease_view is not None:
        report.update(lease_view)
    report["heal"] = heal
    report["finished_at_step"] = heal["step"] if heal is not None and heal["finished"] else None
    report["progress"], report["last_error"] = describe_progress(record, error, time.time())
    if checkpoint_dir is not None:
        report["checkpoint"] = newest_checkpoint(checkpoint_dir)
    return report


def _read_heal_epoch(connection: EtcdConnection, run_id: str) -> bytes | None:
    response = etcd_ops.get_range(
        connection, HealKeys.of(run_id).epoch, what="reading the heal epoch"
    )
    return bytes(response.kvs[0].value) if response.kvs else None


def render_status(report: dict[str, Any]) -> str:
    """Human-readable lines of a status report."""
    lines = [f"run {report['run_id']} on etcd {report['endpoint']}"]
    heal = report.get("heal")
    if heal is not None and heal["finished"]:
        step = "?" if heal["step"] is None else heal["step"]
        lines.append(
            f"  finished at step {step} (epoch {heal['epoch']}, {heal['world_size']} worker(s))"
        )
    elif heal is not None:
        # Healing in place: the members are the workers' epoch; the rendezvous round is history.
        lines.append(f"  epoch {heal['epoch']} (heals in place), {heal['world_size']} member(s)")
        for m in heal["members"]:
            lines.append(
                f"    rank {m['rank']:>3}  {m['node']:<24} local rank {m['local_rank']}  pid {m['pid']}"
            )
    elif not report["found"]:
        lines.append("  no rendezvous state (the run has not started, or its state expired)")
    else:
        flags = ("closed" if report["closed"] else "open") + (
            ", complete" if report["complete"] else ", forming"
        )
        lines.append(
            f"  round {report['round']} ({flags}), {len(report['participants'])} participant(s)"
        )
        for p in report["participants"]:
            age = "?" if p["heartbeat_age_s"] is None else f"{p['heartbeat_age_s']}s"
            lines.append(
                f"    rank {p['rank']:>3}  {p['name']:<24} heartbeat {age:>6} ago  ({p['node']})"
            )
        lines.append(f"  waiting: {', '.join(n['name'] for n in report['waiting']) or 'none'}")
    lines.extend(
        render_progress(
            report.get("progress"),
            report.get("last_error"),
            finished_at=report.get("finished_at_step"),
        )
    )
    if "checkpoint" in report:
        ckpt = report["checkpoint"]
        lines.append(
            "  newest checkpoint: none"
            if ckpt is None
            else f"  newest checkpoint: step {ckpt['step']} (epoch {ckpt['epoch']}), {ckpt['age_s']}s old, {ckpt['path']}"
        )
    return "\n".join(lines)


def render_progress(
    progress: dict[str, Any] | None,
    last_error: dict[str, Any] | None,
    *,
    finished_at: int | None = None,
) -> list[str]:
    """The progress and last-error lines of ``status`` (see :func:`describe_progress`);
    ``finished_at``: the job finished at that step (the last progress published is older)."""
    lines = []
    if finished_at is not None:
        total = progress["total_steps"] if progress is not None else None
        lines.append(
            f"  progress: finished at step {finished_at}" + (f" / {total}" if total else "")
        )
    elif progress is None:
        lines.append(
            "  progress: none published (no training rank 0 right now, or metrics are off)"
        )
    else:
        total = progress["total_steps"]
        step = "?" if progress["step"] is None else str(progress["step"])
        of = (
            f"step {step} / {total} ({progress['percent']}%)"
            if total
            else f"step {step} (no target)"
        )
        rate = progress["samples_per_s"]
        lines.append(
            f"  progress: {of}, ETA {format_duration(progress['eta_s'])}, "
            f"{'-' if rate is None else f'{rate:.1f}'} samples/s, world size {progress['world_size'] or '?'}"
        )
        loss, lr = progress["loss"], progress["lr"]
        lines.append(
            f"    last step {format_duration(progress['last_step_age_s'])} ago, "
            f"loss {'-' if loss is None else f'{loss:.4g}'}, lr {'-' if lr is None else f'{lr:.3g}'}, "
            f"restarts {'-' if progress['restarts'] is None else progress['restarts']}, "
            f"heals {'-' if progress.get('heals') is None else progress['heals']}; "
            f"record published {format_duration(progress['published_age_s'])} ago by {progress['published_by']} "
            "(the ages are the record's: rank 0's node writes one as the step moves)"
        )
    if last_error is None:
        lines.append("  last error: none")
    else:
        lines.append(
            f"  last error: {last_error['text']} ({last_error['node']}, "
            f"{format_duration(last_error['age_s'])} ago)"
        )
    return lines
