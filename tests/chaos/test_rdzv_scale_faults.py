"""The lease rendezvous at CI size: 256 simulated agents on a 3-member etcd cluster, and an etcd
member SIGKILLed in the middle of a round (a follower; the leader, which also forces an election).

The agents are real ``LeaseRendezvousHandler`` objects in two processes
(``benchmarks/scale_agents.py``, the benchmark's own simulator): each holds its own lease and
watches and is driven like torchrun drives it. One agent restarts (its workers "failed"); once
half of them have rejoined the new round, a member is killed. The round must complete through
the two members left, with a consistent result, and without any agent paying more than a
constant number of etcd writes for it. ``benchmarks/rendezvous_scale.py --scenarios`` measures the
same at 1,024 agents (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import importlib.util
import sys
import time
import types
from pathlib import Path

import pytest

from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints
from rendezvous.etcd_server import local_cluster
from rendezvous.round_state import OPEN, RoundState, RunKeys
from rendezvous.settings import DEFAULT_KEY_PREFIX
from rendezvous.watch_hub import prefix_end
from tests.support.etcd_members import leader_first

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]

AGENTS = 256
REPO = Path(__file__).resolve().parents[2]


def load_simulator() -> types.ModuleType:
    """benchmarks/scale_agents.py as a module (benchmarks/ is a folder of scripts)."""
    spec = importlib.util.spec_from_file_location(
        "bench_scale_agents", REPO / "benchmarks" / "scale_agents.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def joined_the_open_round(connection: EtcdConnection, keys: RunKeys) -> int:
    """How many join keys the open round has (0 if no round is open): etcd's view, not an agent's."""
    value, _ = connection.call(lambda c: c.get(keys.state), what="a test read")
    state = None if value is None else RoundState.decode(value, keys.state)
    if state is None or state.status != OPEN:
        return 0
    prefix = keys.round_prefix(state.round).encode()
    request = connection.etcd3.etcdrpc.RangeRequest(
        key=prefix, range_end=prefix_end(prefix), count_only=True
    )
    return int(
        connection.call(lambda c: c.kvstub.Range(request, c.timeout), what="a test count").count
    )


def released_records(reports: list[dict], since: float) -> list[dict]:
    return [
        rec
        for report in reports
        for agent in report["agents"]
        for rec in agent["records"]
        if rec["released"] > since
    ]


@pytest.mark.parametrize("member", ["follower", "leader"])
def test_a_round_of_256_agents_completes_when_an_etcd_member_dies_mid_round(
    tmp_path: Path, member: str
) -> None:
    simulator = load_simulator()
    with local_cluster(tmp_path / "etcd", 3) as servers:
        endpoints = ",".join(s.endpoint for s in servers)
        connection = EtcdConnection(
            EtcdClientConfig(endpoints=parse_endpoints(endpoints), retry_timeout=20)
        )
        fleet = simulator.Fleet(
            backend="lease",
            agents=AGENTS,
            min_nodes=AGENTS,
            max_nodes=AGENTS,
            endpoints=endpoints,
            conf="join_timeout=120,retry_timeout=20",
            per_process=128,
            log_dir=tmp_path / "logs",
            quiet=False,
        )
        try:
            with fleet:
                keys = RunKeys(DEFAULT_KEY_PREFIX, fleet.run_id)
                started = time.monotonic()
                fleet.command("join", fleet.refs)
                fleet.wait_released(fleet.refs, started, 90)
                before = fleet.reports()

                ordered = leader_first(servers)
                victim = ordered[0] if member == "leader" else ordered[1]
                restarted = time.monotonic()
                fleet.command("restart", fleet.refs[-1:])  # one agent's workers "failed"
                deadline = time.monotonic() + 60
                while joined_the_open_round(connection, keys) < AGENTS // 2:
                    assert time.monotonic() < deadline, "half of the agents never rejoined"
                    time.sleep(0.01)
                victim.stop(kill=True)
                fleet.wait_released(fleet.refs, restarted, 90)
                after = fleet.reports()
                assert not victim.is_running()
        finally:
            connection.close()
            for log in sorted((tmp_path / "logs").glob("*.log")):
                text = log.read_text(errors="replace")
                if "Traceback" in text:
                    print(f"--- {log.name}\n{text[-3000:]}")

    records = released_records(after, restarted)
    assert len(records) == AGENTS, "every agent completed the round exactly once"
    assert {r["round"] for r in records} == {1}
    assert {r["world_size"] for r in records} == {AGENTS}
    assert sorted(r["rank"] for r in records) == list(range(AGENTS))
    first_ranks = {
        (p, a["index"]): a["records"][0]["rank"]
        for p, rep in enumerate(before)
        for a in rep["agents"]
    }
    again = {
        (p, a["index"]): a["records"][-1]["rank"]
        for p, rep in enumerate(after)
        for a in rep["agents"]
    }
    assert again == first_ranks, "ranks are stable across rounds"
    # A constant number of writes per agent for the round, whatever the failover cost in retries.
    writes = {
        "a rendezvous join",
        "a rendezvous state change",
        "a coordinator claim",
        "a round close",
        "a new round",
        "a progress count",
        "a store address",
    }
    counted = [{k: v for k, v in rep["request_counts"].items() if k in writes} for rep in after]
    earlier = [{k: v for k, v in rep["request_counts"].items() if k in writes} for rep in before]
    spent = sum(sum(c.values()) for c in counted) - sum(sum(c.values()) for c in earlier)
    assert spent <= 3 * AGENTS, f"{spent} writes for a round of {AGENTS} agents"
    # Nobody read the whole run (a read that grows with N) except a coordinator taking over.
    full_reads = sum(rep["request_counts"].get("a rendezvous read", 0) for rep in after)
    assert full_reads <= 5, f"{full_reads} reads of the whole rendezvous prefix"
