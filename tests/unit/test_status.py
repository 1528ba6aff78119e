"""``elastic-trainer status``'s view of the lease rendezvous, from snapshots built in memory."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_trainer.launch.progress_publisher import ErrorRecord, ProgressRecord
from elastic_trainer.metrics.node_name import node_name, short_host
from elastic_trainer.ops.status import describe_lease_state, describe_progress, render_status
from rendezvous.lease_handler import COMPLETE, NodeInfo, RoundState, RunKeys, Snapshot
from rendezvous.settings import DEFAULT_KEY_PREFIX


def snapshot(
    participants: list[str], live: dict[str, bytes], joined: list[str] | None = None
) -> Snapshot:
    return Snapshot(
        revision=20,
        state=RoundState(2, COMPLETE, participants, None),
        state_revision=19,
        live=set(live),
        joined={2: joined or participants},
        leases={n: 7 for n in live},
        node_values=live,
    )


def test_addresses_come_from_the_stored_node_value() -> None:
    """The stored value wins over the id, even an id that looks like ``ADDR_PID_SUFFIX``."""
    view = describe_lease_state(
        snapshot(
            ["a_1_x", "b_2_y"],
            {
                "a_1_x": NodeInfo("10.0.0.7", 4242).encode(),
                "b_2_y": b'{"addr": "host_with_underscores", "pid": 9}',
            },
        ),
        {"a_1_x": 1.0, "b_2_y": None},
    )
    assert [
        (p["node"], p["addr"], p["pid"], p["rank"], p["alive"]) for p in view["participants"]
    ] == [
        ("a_1_x", "10.0.0.7", 4242, 0, True),
        ("b_2_y", "host_with_underscores", 9, 1, True),
    ]
    # The name metrics use: {short host}-{agent pid} (an IP address is kept whole).
    assert [p["name"] for p in view["participants"]] == ["10.0.0.7-4242", "host_with_underscores-9"]
    assert [p["heartbeat_age_s"] for p in view["participants"]] == [1.0, None]


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"",
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"addr": "h"}',
        b'{"addr": 5, "pid": 1}',
        b'{"addr": "h", "pid": "12"}',
        b'{"addr": "h", "pid": true}',
    ],
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
        "node": "plain",
        "name": "plain",
        "addr": "plain",
        "pid": None,
        "rank": 0,
        "alive": False,
        "heartbeat_age_s": None,
    }


def test_waiting_nodes_use_their_stored_values_too() -> None:
    live = {"a_1_x": NodeInfo("10.0.0.1", 1).encode(), "spare": NodeInfo("10.0.0.9", 99).encode()}
    view = describe_lease_state(snapshot(["a_1_x"], live, joined=["a_1_x", "late_5_z"]), {})
    assert view["waiting"] == [
        {
            "node": "late_5_z",
            "name": "late-5",
            "addr": "late",
            "pid": 5,
        },  # joined, key gone: from its id
        {
            "node": "spare",
            "name": "10.0.0.9-99",
            "addr": "10.0.0.9",
            "pid": 99,
        },  # live, not in the round
    ]


def test_node_info_round_trips() -> None:
    info = NodeInfo("node-3.cluster.local", 31337)
    assert NodeInfo.decode(info.encode()) == info


def test_run_keys_from_params_use_the_key_prefix_or_the_default() -> None:
    default = RunKeys.from_params(RendezvousParameters("etcd-v3", "h:1", "job", 1, 1))
    assert (default.key_prefix, default.run_id) == (DEFAULT_KEY_PREFIX, "job")
    assert default.state == f"{DEFAULT_KEY_PREFIX}/job/rdzv/state"
    custom = RunKeys.from_params(
        RendezvousParameters("etcd-v3", "h:1", "job", 1, 1, key_prefix="/x/y/")
    )
    assert custom.node("n") == "/x/y/job/rdzv/nodes/n" and custom.store == "/x/y/job/store"


@pytest.mark.parametrize("prefix", ["relative/path", "/with space", ""])
def test_run_keys_refuse_a_key_prefix_that_is_not_an_absolute_path(prefix: str) -> None:
    """One check for the handler and for status: an absolute path without spaces."""
    params = RendezvousParameters("etcd-v3", "h:1", "job", 1, 1, key_prefix=prefix)
    with pytest.raises(ValueError, match="rdzv-conf key_prefix: must be an absolute path"):
        RunKeys.from_params(params)


def test_node_names_use_the_short_host_and_the_agent_pid() -> None:
    assert node_name("node-3.cluster.local", 31337) == "node-3-31337"
    assert node_name("fe80::1", 7) == "fe80::1-7" and short_host("[::1]") == "::1"
    assert node_name("10.1.2.3", None) == "10.1.2.3" and short_host("") == "unknown"


RECORD = ProgressRecord(node="a-1", published_unix=1000.0, step=150, total_steps=1000, world_size=4,
                        steps_per_s=5.0, samples_per_s=1280.04, step_time_p50_s=0.2, loss=0.51234, lr=0.05,
                        last_step_unix=998.0, last_checkpoint_step=100, last_checkpoint_unix=900.0, restarts=1,
                        heals=3)  # fmt: skip


def test_progress_with_eta_and_ages() -> None:
    progress, error = describe_progress(RECORD, ErrorRecord(node="b-2", text="rank 3 exited with signal 9", unix=880.0),
                                        now_unix=1003.0)  # fmt: skip
    assert progress is not None and error is not None
    assert (progress["step"], progress["total_steps"], progress["percent"]) == (150, 1000, 15.0)
    assert progress["eta_s"] == 170.0  # (1000 - 150) / 5
    assert (
        progress["world_size"],
        progress["samples_per_s"],
        progress["restarts"],
        progress["heals"],
    ) == (4, 1280.0, 1, 3)
    assert (
        progress["last_step_age_s"],
        progress["published_age_s"],
        progress["last_checkpoint_age_s"],
    ) == (5.0, 3.0, 103.0)
    assert progress["published_by"] == "a-1"
    assert error == {"text": "rank 3 exited with signal 9", "node": "b-2", "age_s": 123.0}


def test_progress_unknowns_stay_unknown() -> None:
    record = ProgressRecord(node="a-1", published_unix=1000.0, step=3)
    progress, error = describe_progress(record, None, now_unix=1000.0)
    assert progress is not None and error is None
    assert (progress["eta_s"], progress["percent"], progress["samples_per_s"]) == (None, None, None)
    assert describe_progress(None, None, now_unix=1.0) == (None, None)


def report(progress: dict | None, last_error: dict | None) -> dict:
    return {"run_id": "job", "endpoint": "e:2379", "found": True, "handler": "lease", "round": 2,
            "complete": True, "closed": False, "waiting": [], "redundant": [],
            "participants": [{"node": "host.x_42_abcdef", "name": "host-42", "rank": 0, "heartbeat_age_s": 1.0}],
            "progress": progress, "last_error": last_error}  # fmt: skip


def test_render_shows_names_progress_and_the_last_error() -> None:
    progress, error = describe_progress(RECORD, ErrorRecord(node="b-2", text="rank 3 exited with signal 9", unix=880.0),
                                        now_unix=1003.0)  # fmt: skip
    text = render_status(report(progress, error))
    assert "rank   0  host-42" in text and "(host.x_42_abcdef)" in text
    assert "progress: step 150 / 1000 (15.0%), ETA 2m50s, 1280.0 samples/s, world size 4" in text
    assert (
        "last step 5.0s ago, loss 0.5123, lr 0.05, restarts 1, heals 3; record published 3.0s ago "
        "by a-1 (the ages are the record's: rank 0's node writes one as the step moves)" in text
    )
    assert "last error: rank 3 exited with signal 9 (b-2, 2m03s ago)" in text


def test_render_without_progress() -> None:
    text = render_status(report(None, None))
    assert "progress: none published" in text and "last error: none" in text
