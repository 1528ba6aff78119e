"""Run isolation: a node of another job is refused a run id that a job is using.

A copy-pasted ``--rdzv-id`` must not let a different script join a running job (both would
crash in DDP, and the healthy job would end with its run closed). So every node states what it
runs -- a :class:`JobIdentity`: the script or module, its arguments and the ``--nnodes`` bounds,
not ``--nproc-per-node`` (nodes may differ in size) -- and before it touches the rendezvous,
:func:`claim_run` runs one etcd transaction on ``{key_prefix}/{run_id}/job``: create it with this
identity if it is absent, else compare fingerprints. A different job gets
:class:`RunIdInUseError` (one line naming the run id, what runs there and what this node runs)
and has written nothing; the same job -- any node, any later restart of the same command --
passes. The script is compared as written on the command line (``./train.py`` is ``train.py``),
not as an absolute path, so nodes whose checkouts live in different folders agree.

The record lives as long as the run's state, for good (the closed state stays too, so a run id
serves one job).

Where the identity comes from: :func:`set_job_identity` (``elastic-trainer run`` calls it: it
knows the real target even when workers start through a warm-start client); otherwise, in a
plain ``torchrun`` process, torchrun's own command line. With neither, no check is made.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousStateError

from rendezvous.etcd_client import EtcdConnection

log = logging.getLogger(__name__)


class RunIdInUseError(RendezvousError):
    """Another job holds this run id; the message is one line."""


@dataclass(frozen=True, slots=True)
class JobIdentity:
    """What a job runs, as far as the nodes of one job must agree."""

    target: str
    """The training script (as written on the command line) or the module name."""
    module: bool = False
    """``target`` is a module (``-m``)."""
    args: tuple[str, ...] = ()
    """The arguments after the target."""
    min_nodes: int = 1
    """``--nnodes`` minimum."""
    max_nodes: int = 1
    """``--nnodes`` maximum."""

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("target: must not be empty")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"nnodes: need 1 <= min ({self.min_nodes}) <= max ({self.max_nodes})")
        if not self.module:
            object.__setattr__(self, "target", os.path.normpath(self.target))
        object.__setattr__(self, "args", tuple(self.args))

    @classmethod
    def create(cls, target: str, args: Sequence[str], *, module: bool, nnodes: str) -> JobIdentity:
        """The identity of ``[-m] target args...`` under ``--nnodes N`` or ``MIN:MAX``.

        Raises:
            ValueError: ``nnodes`` is malformed, or the target is empty.
        """
        low, sep, high = str(nnodes).partition(":")
        try:
            min_nodes, max_nodes = int(low), int(high if sep else low)
        except ValueError:
            raise ValueError(f"nnodes: {nnodes!r} is not N or MIN:MAX") from None
        return cls(target, module, tuple(args), min_nodes, max_nodes)

    @property
    def fingerprint(self) -> str:
        """A stable hash of the identity (the same on every node and every restart)."""
        data = {
            "v": 1,
            "target": self.target,
            "module": self.module,
            "args": list(self.args),
            "nnodes": [self.min_nodes, self.max_nodes],
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:32]

    @property
    def description(self) -> str:
        """For people: ``'-m pkg.train --lr 0.1' with --nnodes 1:2``."""
        command = shlex.join([*(["-m"] if self.module else []), self.target, *self.args])
        return f"'{command}' with --nnodes {self.min_nodes}:{self.max_nodes}"

    def encode(self) -> bytes:
        """The value stored under the run's ``job`` key."""
        return json.dumps(
            {
                "fingerprint": self.fingerprint,
                "job": self.description,
                "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
        ).encode()


_identity: JobIdentity | None = None


def set_job_identity(identity: JobIdentity | None) -> None:
    """Declare what this process's job runs (``None``: forget it), before its handler is made."""
    global _identity
    _identity = identity


def current_job_identity() -> JobIdentity | None:
    """The declared identity, else the one of a plain ``torchrun`` command line, else ``None``."""
    if _identity is not None:
        return _identity
    return identity_from_torchrun_argv(sys.argv)


def _is_torchrun(argv0: str) -> bool:
    path = os.path.normpath(argv0)
    return os.path.basename(path) == "torchrun" or path.endswith(
        os.path.join("torch", "distributed", "run.py")
    )


def identity_from_torchrun_argv(argv: Sequence[str]) -> JobIdentity | None:
    """The identity of a ``torchrun`` (or ``python -m torch.distributed.run``) command line;
    ``None`` when ``argv`` is not torchrun's or cannot be read."""
    if not argv or not _is_torchrun(argv[0]):
        return None
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    try:
        args = get_args_parser().parse_args(list(argv[1:]))
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
        return JobIdentity(
            args.training_script,
            bool(args.module),
            tuple(args.training_script_args),
            int(min_nodes),
            int(max_nodes),
        )
    except (SystemExit, ValueError, RuntimeError) as exc:  # torchrun parsed it; we cannot: no check
        log.info(
            "etcd-v3: cannot read the job from torchrun's command line (%s); run isolation is off",
            exc,
        )
        return None


def _stored(value: bytes, key: str) -> tuple[str, str]:
    try:
        data = json.loads(value)
        return str(data["fingerprint"]), str(data["job"])
    except (ValueError, KeyError, TypeError) as exc:
        raise RendezvousStateError(f"the job record at {key} is malformed: {exc}") from exc


def claim_run(
    connection: EtcdConnection,
    key: str,
    identity: JobIdentity,
    *,
    run_id: str,
) -> None:
    """Record ``identity`` as the job of ``run_id`` at ``key``, or check that it is the one there.

    One transaction (create if absent, else read), so concurrent first nodes agree and a retried
    create finds its own record.

    Raises:
        RunIdInUseError: another job holds the run id; nothing was written.
        RendezvousConnectionError: etcd cannot be reached.
        RendezvousStateError: the stored record is not ours.
    """
    txn = connection.etcd3.transactions
    value = identity.encode()

    def attempt(client: Any) -> tuple[bool, Any]:
        return client.transaction(  # type: ignore[no-any-return]
            compare=[txn.Create(key) == 0],
            success=[txn.Put(key, value)],
            failure=[txn.Get(key)],
        )

    for _ in range(5):  # the record can vanish between the compare and the read if it is deleted
        created, responses = connection.call(attempt, what="a job identity check")
        if created:
            log.info("etcd-v3: run %s runs %s", run_id, identity.description)
            return
        current = responses[0] if responses else []
        if not current:
            continue
        fingerprint, description = _stored(current[0][0], key)
        if fingerprint == identity.fingerprint:
            return
        raise RunIdInUseError(
            f"run id {run_id!r} is in use by another job: it runs {description}, this node runs "
            f"{identity.description}; give this job its own run id (--rdzv-id / --run-id)"
        )
    raise RendezvousStateError(f"the job record at {key} keeps vanishing")
