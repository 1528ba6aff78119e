"""What the lease rendezvous keeps in etcd, and the rules that decide a round (pure functions).

Keys under ``{key_prefix}/{run_id}/`` (``RunKeys``)::

    rdzv/state               framed JSON (RoundState): round, status, world size, shard count,
                             previous round, joined count (progress), rank 0's store address
    rdzv/state/coordinator   the node deciding rounds now (attached to its lease)
    rdzv/state/master        rank 0's store address, when rank 0 is not the coordinator
    rdzv/nodes/<node>        a live node (attached to its lease); JSON NodeInfo {"addr", "pid"}
    rdzv/rounds/<r>/<node>   node joined round r (attached to its lease)
    rdzv/ranks/<k>           framed JSON: round r's ranks of the nodes whose id hashes to shard k
    store/...                the rendezvous store (EtcdV3Store), per round under a prefix
    job                      what the job runs (rendezvous.job_identity)
    debug/<node>/<local>     JSON: a worker's diagnostics endpoint, its rank and world (written by
                             the worker: elastic_trainer/train/diagnostics.py)

Invariants:

* Every node watches ``rdzv/state*`` (three small keys) and its own rank shard, never a prefix
  whose size grows with the job: a round costs each node a constant number of requests and
  events. Only the coordinator watches ``nodes/`` and ``rounds/``.
* ``state`` and all the shards of a round are written in one transaction, guarded by the state's
  revision and by the coordinator key's value, so a deposed coordinator can never publish.
* A round's participants are never stored as one list: ``read_snapshot`` assembles them from the
  shards (for ``elastic-trainer status``, a join-timeout message, a new coordinator).
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from rendezvous.etcd_client import EtcdConnection
from rendezvous.framing import frame_state, unframe_state
from rendezvous.settings import RendezvousSettings, parse_settings
from rendezvous.watch_hub import prefix_end

OPEN, COMPLETE, CLOSED = "open", "complete", "closed"

NODES_PER_SHARD = 100
"""Expected nodes per rank shard at ``max_nodes``: what one node reads of a round (~5 KB)."""
MAX_SHARDS = 120
"""Shards of one round at most, so that they and the state fit one etcd transaction (etcd's
default ``--max-txn-ops`` is 128). Beyond 12,000 nodes shards grow instead."""


def shard_count(max_nodes: int) -> int:
    """How many rank shards a job of at most ``max_nodes`` nodes uses."""
    return max(1, min(MAX_SHARDS, math.ceil(max_nodes / NODES_PER_SHARD)))


def shard_of(node: str, shards: int) -> int:
    """The shard that holds ``node``'s rank (stable across processes and Python versions)."""
    return zlib.crc32(node.encode()) % shards


@dataclass(slots=True)
class RoundState:
    """The decoded ``rdzv/state`` key.

    ``participants`` (in rank order) and ``previous`` (the previous round's participants; ``None``
    in a job's first round) are not stored in the key: :func:`read_snapshot` fills them from the
    rank shards, the coordinator keeps them in memory.
    """

    round: int
    status: str
    participants: list[str] = field(default_factory=list)
    previous: list[str] | None = None
    world_size: int = 0
    """``complete``/``closed``: the number of participants."""
    shards: int = 0
    """``complete``/``closed``: how many rank shards hold the participants."""
    previous_round: int | None = None
    """``open``: the round whose participants must rejoin (``None``: a job's first round)."""
    joined: int = 0
    """``open``: how many nodes had joined when the coordinator last said (progress lines)."""
    master: str | None = None
    """``complete``: ``host:port`` of rank 0's store when the coordinator is rank 0."""

    def encode(self) -> bytes:
        data: dict[str, Any] = {"round": self.round, "status": self.status}
        if self.status == OPEN:
            data.update(previous_round=self.previous_round, joined=self.joined)
        else:
            data.update(world_size=self.world_size, shards=self.shards)
            if self.master:
                data["master"] = self.master
        return frame_state(json.dumps(data, sort_keys=True).encode())

    @classmethod
    def decode(cls, raw: bytes, key: str) -> RoundState:
        try:
            data = json.loads(unframe_state(raw, key=key))
            previous_round = data.get("previous_round")
            state = cls(
                int(data["round"]),
                str(data["status"]),
                world_size=int(data.get("world_size", 0)),
                shards=int(data.get("shards", 0)),
                previous_round=None if previous_round is None else int(previous_round),
                joined=int(data.get("joined", 0)),
                master=data.get("master"),
            )
        except RendezvousStateError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RendezvousStateError(
                f"the rendezvous state at {key} is malformed: {exc}"
            ) from exc
        if state.status not in (OPEN, COMPLETE, CLOSED):
            raise RendezvousStateError(
                f"the rendezvous state at {key} has unknown status {state.status!r}"
            )
        return state


def encode_shard(round_: int, ranks: dict[str, int]) -> bytes:
    """A rank shard's value: ``round_``'s ranks of some of its participants."""
    return frame_state(json.dumps({"round": round_, "ranks": ranks}, sort_keys=True).encode())


def decode_shard(raw: bytes, key: str) -> tuple[int, dict[str, int]]:
    """``(round, {node: rank})`` of a shard value.

    Raises:
        RendezvousStateError: the value is corrupt or not a shard.
    """
    try:
        data = json.loads(unframe_state(raw, key=key))
        ranks = {str(node): int(rank) for node, rank in data["ranks"].items()}
        return int(data["round"]), ranks
    except RendezvousStateError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousStateError(f"the rank shard at {key} is malformed: {exc}") from exc


@dataclass(frozen=True, slots=True)
class MasterInfo:
    """Where rank 0's store of a round listens (``rdzv/state/master``, or in the state)."""

    round: int
    addr: str
    port: int

    def encode(self) -> bytes:
        return json.dumps({"round": self.round, "addr": self.addr, "port": self.port}).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> MasterInfo | None:
        """The stored address, or ``None`` if ``raw`` is missing or malformed."""
        try:
            data = json.loads(raw or b"")
            return cls(int(data["round"]), str(data["addr"]), int(data["port"]))
        except (ValueError, TypeError, KeyError):
            return None

    @classmethod
    def of_state(cls, state: RoundState) -> MasterInfo | None:
        """The address a complete state carries, if any."""
        if not state.master:
            return None
        host, _, port = state.master.rpartition(":")
        try:
            return cls(state.round, host, int(port))
        except ValueError:
            return None


@dataclass(slots=True)
class Snapshot:
    """One consistent read of everything under ``rdzv/``."""

    revision: int
    state: RoundState | None
    state_revision: int
    live: set[str]
    joined: dict[int, list[str]]  # round -> nodes in join (create revision) order
    leases: dict[str, int] = field(default_factory=dict)  # live node -> its lease id
    node_values: dict[str, bytes] = field(
        default_factory=dict
    )  # live node -> its key's value (NodeInfo)
    coordinator: str | None = None
    join_revisions: dict[int, dict[str, int]] = field(
        default_factory=dict
    )  # round -> node -> create revision
    master: MasterInfo | None = None


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node stores under its ``rdzv/nodes/<node>`` key: where it runs."""

    addr: str
    pid: int

    def encode(self) -> bytes:
        return json.dumps({"addr": self.addr, "pid": self.pid}).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> NodeInfo | None:
        """The stored info, or ``None`` if ``raw`` is missing or not a node value."""
        if not raw:
            return None
        try:
            data = json.loads(raw)
            addr, pid = data["addr"], data["pid"]
        except (ValueError, TypeError, KeyError, RecursionError):  # JSON/UTF-8 errors: ValueError
            return None
        if not isinstance(addr, str) or not isinstance(pid, int) or isinstance(pid, bool):
            return None
        return cls(addr, pid)


class RunKeys:
    """The etcd keys of one run's lease rendezvous."""

    def __init__(self, key_prefix: str, run_id: str) -> None:
        self.key_prefix, self.run_id = key_prefix, run_id
        base = f"{key_prefix.rstrip('/')}/{run_id}"
        self.rdzv = f"{base}/rdzv/"
        self.state = f"{base}/rdzv/state"
        self.coordinator = f"{base}/rdzv/state/coordinator"
        self.master = f"{base}/rdzv/state/master"
        self.nodes = f"{base}/rdzv/nodes/"
        self.rounds = f"{base}/rdzv/rounds/"
        self.ranks = f"{base}/rdzv/ranks/"
        self.store = f"{base}/store"
        self.job = f"{base}/job"
        self.debug = f"{base}/debug/"
        """Each worker's diagnostics endpoint, ``debug/<node>/<local rank>`` (its process writes
        it at every start and heal: ``elastic_trainer/train/diagnostics.py``)."""

    @classmethod
    def from_settings(cls, settings: RendezvousSettings) -> RunKeys:
        """The keys of the settings' run under their ``key_prefix``."""
        return cls(settings.key_prefix, settings.run_id)

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> RunKeys:
        """The keys of ``params.run_id`` under the ``key_prefix`` rdzv-conf key (default
        :data:`rendezvous.settings.DEFAULT_KEY_PREFIX`): the handler's and ``status``'s.

        Raises:
            RendezvousConfigError: a malformed parameter (see :func:`parse_settings`)."""
        return cls.from_settings(parse_settings(params))

    def node(self, node: str) -> str:
        return self.nodes + node

    def joined(self, round_: int, node: str) -> str:
        return f"{self.rounds}{round_}/{node}"

    def round_prefix(self, round_: int) -> str:
        return f"{self.rounds}{round_}/"

    def shard(self, index: int) -> str:
        return f"{self.ranks}{index}"


def read_snapshot(connection: EtcdConnection, keys: RunKeys) -> Snapshot:
    """Everything under ``rdzv/`` in one request: its size grows with the job, so only
    ``elastic-trainer status``, a new coordinator and a join-timeout message read it."""
    response = connection.call(
        lambda client: client.get_prefix_response(keys.rdzv), what="a rendezvous read", read=True
    )
    state, state_revision, live, leases, values = None, 0, set(), {}, {}
    coordinator, master = None, None
    join_revisions: dict[int, dict[str, int]] = {}
    shards: dict[int, dict[str, int]] = {}  # round -> node -> rank
    for kv in response.kvs:
        key = kv.key.decode()
        if key == keys.state:
            state, state_revision = RoundState.decode(kv.value, key), kv.mod_revision
        elif key == keys.coordinator:
            coordinator = kv.value.decode(errors="replace")
        elif key == keys.master:
            master = MasterInfo.decode(kv.value)
        elif key.startswith(keys.nodes):
            node = key[len(keys.nodes) :]
            live.add(node)
            leases[node] = int(kv.lease)
            values[node] = bytes(kv.value)
        elif key.startswith(keys.rounds):
            round_text, _, node = key[len(keys.rounds) :].partition("/")
            join_revisions.setdefault(int(round_text), {})[node] = kv.create_revision
        elif key.startswith(keys.ranks):
            round_, ranks = decode_shard(kv.value, key)
            shards.setdefault(round_, {}).update(ranks)
    if state is not None:
        if state.status in (COMPLETE, CLOSED):
            state.participants = _by_rank(shards.get(state.round, {}))
        elif state.previous_round is not None:
            state.previous = _by_rank(shards.get(state.previous_round, {}))
    joined = {r: sorted(nodes, key=nodes.__getitem__) for r, nodes in join_revisions.items()}
    return Snapshot(
        response.header.revision,
        state,
        state_revision,
        live,
        joined,
        leases,
        values,
        coordinator,
        join_revisions,
        master,
    )


def _by_rank(ranks: dict[str, int]) -> list[str]:
    return sorted(ranks, key=ranks.__getitem__)


def close_ready(
    *,
    joined: int,
    first_round: bool,
    missing_previous: int,
    waited: float,
    settings: RendezvousSettings,
) -> bool:
    """Whether an open round may close, from counts alone (the coordinator asks on every event).

    Args:
        joined: live nodes that joined the round.
        first_round: the job's first round (no previous participants).
        missing_previous: live participants of the previous round that have not rejoined.
        waited: seconds since ``min_nodes`` were first in (0 if not yet).
    """
    if joined < settings.min_nodes:
        return False
    if joined >= settings.max_nodes:
        return True
    if not first_round:
        return missing_previous == 0
    return waited >= settings.last_call_timeout


def decide_close(
    snapshot: Snapshot, settings: RendezvousSettings, min_reached_for: float
) -> list[str] | None:
    """The participants of the open round if it may close now, else ``None``.

    Args:
        snapshot: the current view; its state must be ``open``.
        min_reached_for: seconds since this node first saw ``min_nodes`` joined (0 if not yet).
    """
    state = snapshot.state
    if state is None or state.status != OPEN:
        return None
    joined = [n for n in snapshot.joined.get(state.round, []) if n in snapshot.live]
    in_round = set(joined)
    missing = [n for n in state.previous or [] if n in snapshot.live and n not in in_round]
    if not close_ready(
        joined=len(joined),
        first_round=state.previous is None,
        missing_previous=len(missing),
        waited=min_reached_for,
        settings=settings,
    ):
        return None
    return order_participants(joined, state.previous)[: settings.max_nodes]


def order_participants(joined: list[str], previous: list[str] | None) -> list[str]:
    """Previous members keep their relative order (rank 0 stays rank 0); newcomers follow."""
    in_round = set(joined)
    before = [n for n in (previous or []) if n in in_round]
    kept = set(before)
    return before + [n for n in joined if n not in kept]


def waiting_summary(snapshot: Snapshot, settings: RendezvousSettings, node_id: str) -> str:
    """Why a round has not closed for ``node_id``, for people (the join-timeout error)."""
    state = snapshot.state
    if state is None:
        return "no round was open"
    if state.status == COMPLETE:
        live = [n for n in state.participants if n in snapshot.live]
        return (
            f"the job is full ({len(live)} of max {settings.max_nodes} nodes run it); "
            "this node waited as a spare"
        )
    if state.status != OPEN:
        return f"the rendezvous is {state.status}"
    joined = [n for n in snapshot.joined.get(state.round, []) if n in snapshot.live]
    if len(joined) < settings.min_nodes:
        return f"{len(joined)} of min {settings.min_nodes} nodes had joined round {state.round}"
    in_round = set(joined)
    missing = [n for n in state.previous or [] if n in snapshot.live and n not in in_round]
    if missing:
        shown = ", ".join(missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        return (
            f"{len(joined)} nodes had joined round {state.round}; {len(missing)} live member(s) "
            f"of the previous round had not rejoined: {shown}"
        )
    return f"{len(joined)} nodes had joined round {state.round} (min {settings.min_nodes}), still in the last call"


def range_end(prefix: str) -> bytes:
    """The end of the key range of ``prefix``."""
    return prefix_end(prefix.encode())
