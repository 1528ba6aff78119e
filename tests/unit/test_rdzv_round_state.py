"""What the lease rendezvous stores and the rules a coordinator applies, as pure functions: the
state's encoding, rank shards, the count-only close rule, and the retry deadlines."""

from __future__ import annotations

import contextlib
import types
import zlib

import pytest
from torch.distributed.elastic.rendezvous import RendezvousStateError

from rendezvous.etcd_ops import _Patience
from rendezvous.round_state import (
    CLOSED,
    COMPLETE,
    MAX_SHARDS,
    OPEN,
    MasterInfo,
    RoundState,
    close_ready,
    decode_shard,
    encode_shard,
    order_participants,
    shard_count,
    shard_of,
)
from rendezvous.settings import RendezvousSettings

SETTINGS = RendezvousSettings(run_id="r", min_nodes=2, max_nodes=4, last_call_timeout=30)


@pytest.mark.parametrize(
    "state",
    [
        RoundState(0, OPEN),
        RoundState(3, OPEN, previous_round=2, joined=17),
        RoundState(4, COMPLETE, world_size=9, shards=2, master="10.0.0.1:29500"),
        RoundState(4, CLOSED, world_size=9, shards=2),
    ],
)
def test_the_state_round_trips_without_its_participants(state: RoundState) -> None:
    state.participants = ["a", "b"]  # filled from the shards on reading, never stored
    decoded = RoundState.decode(state.encode(), "k")
    assert decoded.participants == []
    assert (
        decoded.round,
        decoded.status,
        decoded.world_size,
        decoded.shards,
        decoded.previous_round,
        decoded.joined,
        decoded.master,
    ) == (
        state.round,
        state.status,
        state.world_size,
        state.shards,
        state.previous_round,
        state.joined,
        state.master,
    )


def test_the_stored_state_does_not_grow_with_the_job() -> None:
    small = RoundState(1, COMPLETE, world_size=2, shards=1).encode()
    large = RoundState(1, COMPLETE, world_size=10_000, shards=MAX_SHARDS).encode()
    assert len(large) - len(small) < 10


def test_a_corrupt_state_or_shard_is_a_state_error() -> None:
    value = bytearray(RoundState(1, OPEN).encode())
    value[-2] ^= 0xFF
    with pytest.raises(RendezvousStateError, match="checksum"):
        RoundState.decode(bytes(value), "k")
    with pytest.raises(RendezvousStateError, match="not an etcd-v3 state"):
        decode_shard(b"garbage", "k")


def test_shards_hold_about_a_hundred_nodes_and_fit_one_transaction() -> None:
    assert shard_count(1) == shard_count(100) == 1
    assert shard_count(101) == 2
    assert shard_count(10_000) == 100
    assert shard_count(1_000_000) == MAX_SHARDS < 128  # etcd's default --max-txn-ops


def test_a_node_finds_its_shard_from_its_id_alone() -> None:
    node = "host-a_1234_abcdef01"
    assert shard_of(node, 100) == zlib.crc32(node.encode()) % 100  # stable across processes
    nodes = [f"10.0.{i // 256}.{i % 256}_4242_{i:08x}" for i in range(10_000)]
    sizes = [0] * 100
    for n in nodes:
        sizes[shard_of(n, 100)] += 1
    assert max(sizes) < 160, "no shard holds much more than its share"


def test_a_shard_round_trips() -> None:
    ranks = {f"n{i}": i for i in range(100)}
    assert decode_shard(encode_shard(7, ranks), "k") == (7, ranks)


@pytest.mark.parametrize(
    ("joined", "first_round", "missing", "waited", "expected"),
    [
        (1, True, 0, 99.0, False),  # below the minimum: never
        (2, True, 0, 0.0, False),  # first round: the last call
        (2, True, 0, 30.0, True),
        (4, True, 0, 0.0, True),  # the maximum closes at once
        (3, False, 1, 0.0, False),  # a live member of the previous round has not rejoined
        (3, False, 0, 0.0, True),  # later rounds: no last call
    ],
)
def test_close_ready_from_counts(
    joined: int, first_round: bool, missing: int, waited: float, expected: bool
) -> None:
    assert (
        close_ready(
            joined=joined,
            first_round=first_round,
            missing_previous=missing,
            waited=waited,
            settings=SETTINGS,
        )
        is expected
    )


def test_ordering_ten_thousand_nodes_is_linear() -> None:
    previous = [f"n{i}" for i in range(10_000)]
    joined = list(reversed(previous)) + ["new"]
    ordered = order_participants(joined, previous)  # quadratic would take minutes here
    assert ordered[:3] == ["n0", "n1", "n2"] and ordered[-1] == "new"


def test_the_master_address_comes_from_the_state_or_its_key() -> None:
    assert MasterInfo.of_state(RoundState(3, COMPLETE, master="h:29500")) == MasterInfo(
        3, "h", 29500
    )
    assert MasterInfo.of_state(RoundState(3, COMPLETE)) is None
    assert MasterInfo.decode(MasterInfo(2, "h", 1).encode()) == MasterInfo(2, "h", 1)
    assert MasterInfo.decode(b"{}") is None and MasterInfo.decode(None) is None


def _deadlines_given(first: float | None, tooks: tuple[float | None, ...]) -> list[float]:
    """The deadline of each attempt when attempt i takes ``tooks[i]`` seconds to fail (``None``:
    it is answered); the read timeout is 10 s."""
    now = [0.0]
    client = types.SimpleNamespace(timeout=10.0)
    patience = _Patience(first, clock=lambda: now[0])
    given: list[float] = []
    for took in tooks:

        def rpc(timeout: float, took: float | None = took) -> str:
            given.append(timeout)
            if took is None:
                return "answered"
            now[0] += took
            raise RuntimeError("failed")

        with contextlib.suppress(RuntimeError):
            assert patience.send(client, rpc) == "answered"
    return given


def test_retry_deadlines_double_after_a_timeout_only_up_to_the_read_timeout() -> None:
    """An attempt that waited its deadline out doubles the next one (etcd may just be slow); one
    refused at once keeps it, so the next member gets the same short deadline (session 13: a
    round close sent to a follower during a leader election after a refused first attempt got 5 s,
    and etcd held it for its own 5 s request timeout)."""
    # refused, refused, timed out, refused, timed out, timed out at the cap, timed out, answered
    assert _deadlines_given(2.5, (0.01, 0.01, 2.5, 0.0, 5.0, 10.0, 10.0, None)) == [
        2.5,
        2.5,
        2.5,
        5.0,
        5.0,
        10.0,
        10.0,
        10.0,
    ]
    assert _deadlines_given(None, (None,)) == [10.0]


def test_every_request_requires_a_leader_and_keeps_the_client_s_token() -> None:
    from rendezvous.etcd_ops import REQUIRE_LEADER, request_metadata

    assert request_metadata(types.SimpleNamespace(metadata=None)) == (REQUIRE_LEADER,)
    assert request_metadata(types.SimpleNamespace(metadata=(("token", "t"),))) == (
        ("token", "t"),
        REQUIRE_LEADER,
    )
    assert REQUIRE_LEADER == (
        "hasleader",
        "true",
    )  # etcd's rpctypes.MetadataRequireLeaderKey / MetadataHasLeader


def test_a_round_request_first_waits_a_quarter_of_the_lease_ttl_bounded_by_two_seconds_and_the_read_timeout() -> (
    None
):
    """A write held by a dead leader moves to a live member within 2.5 s at the default
    ``lease_ttl=10``; never above ``read_timeout``, never below 2 s."""
    from dataclasses import replace

    from rendezvous.lease_handler import round_deadline

    assert round_deadline(SETTINGS) == 2.5  # lease_ttl 10
    assert round_deadline(replace(SETTINGS, lease_ttl=32)) == 8.0
    assert round_deadline(replace(SETTINGS, lease_ttl=60)) == 10.0  # read_timeout
    assert round_deadline(replace(SETTINGS, lease_ttl=3)) == 2.0
