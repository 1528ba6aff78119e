"""``elastic-trainer status``'s view of the lease rendezvous, from snapshots built in memory."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_trainer.status import describe_lease_state
from rendezvous.etcd_backend import DEFAULT_KEY_PREFIX
from rendezvous.lease_handler import COMPLETE, NodeInfo, RoundState, RunKeys, Snapshot


def snapshot(participants: list[str], live: dict[str, bytes], joined: list[str] | None = None) -> Snapshot:
    return Snapshot(
        revision=20, state=RoundState(2, COMPLETE, participants, None), state_revision=19,
        live=set(live), joined={2: joined or participants}, leases={n: 7 for n in live}, node_values=live,
    )


def test_addresses_come_from_the_stored_node_value() -> None:
    """The stored value wins over the id, even an id that looks like ``ADDR_PID_SUFFIX``."""
    view = describe_lease_state(
        snapshot(["a_1_x", "b_2_y"], {"a_1_x": NodeInfo("10.0.0.7", 4242).encode(),
                                      "b_2_y": b'{"addr": "host_with_underscores", "pid": 9}'}),
        {"a_1_x": 1.0, "b_2_y": None},
    )
    assert [(p["node"], p["addr"], p["pid"], p["rank"], p["alive"]) for p in view["participants"]] == [
        ("a_1_x", "10.0.0.7", 4242, 0, True),
        ("b_2_y", "host_with_underscores", 9, 1, True),
    ]
    assert [p["heartbeat_age_s"] for p in view["participants"]] == [1.0, None]


@pytest.mark.parametrize(
    "value",
    [None, b"", b"not json", b"\xff\xfe", b"[1, 2]", b'{"addr": "h"}', b'{"addr": 5, "pid": 1}',
     b'{"addr": "h", "pid": "12"}', b'{"addr": "h", "pid": true}'],
)
def test_a_missing_or_bad_value_falls_back_to_the_node_id(value: bytes | None) -> None:
    live = {} if value is None else {"host-a_123_abcdef": value}
    view = describe_lease_state(snapshot(["host-a_123_abcdef"], live), {})
    (participant,) = view["participants"]
    assert (participant["addr"], participant["pid"]) == ("host-a", 123)
    assert participant["alive"] is (value is not None)


def test_an_id_of_another_shape_without_a_value_is_shown_as_is() -> None:
    view = describe_lease_state(snapshot(["plain"], {}), {})
    assert view["participants"][0] | {"rank": 0} == {
        "node": "plain", "addr": "plain", "pid": None, "rank": 0, "alive": False, "heartbeat_age_s": None,
    }


def test_waiting_nodes_use_their_stored_values_too() -> None:
    live = {"a_1_x": NodeInfo("10.0.0.1", 1).encode(), "spare": NodeInfo("10.0.0.9", 99).encode()}
    view = describe_lease_state(snapshot(["a_1_x"], live, joined=["a_1_x", "late_5_z"]), {})
    assert view["waiting"] == [
        {"node": "late_5_z", "addr": "late", "pid": 5},  # joined, key gone: from its id
        {"node": "spare", "addr": "10.0.0.9", "pid": 99},  # live, not in the round
    ]


def test_node_info_round_trips() -> None:
    info = NodeInfo("node-3.cluster.local", 31337)
    assert NodeInfo.decode(info.encode()) == info


def test_run_keys_from_params_use_the_key_prefix_or_the_default() -> None:
    default = RunKeys.from_params(RendezvousParameters("etcd-v3", "h:1", "job", 1, 1))
    assert (default.key_prefix, default.run_id) == (DEFAULT_KEY_PREFIX, "job")
    assert default.state == f"{DEFAULT_KEY_PREFIX}/job/rdzv/state"
    custom = RunKeys.from_params(RendezvousParameters("etcd-v3", "h:1", "job", 1, 1, key_prefix="/x/y/"))
    assert custom.node("n") == "/x/y/job/rdzv/nodes/n" and custom.store == "/x/y/job/store"


@pytest.mark.parametrize("prefix", ["relative/path", "/with space", ""])
def test_run_keys_refuse_a_key_prefix_the_dynamic_handler_refuses(prefix: str) -> None:
    """One check for both handlers (and for status): an absolute path without spaces."""
    params = RendezvousParameters("etcd-v3", "h:1", "job", 1, 1, key_prefix=prefix)
    with pytest.raises(ValueError, match="rdzv-conf key_prefix: must be an absolute path"):
        RunKeys.from_params(params)
