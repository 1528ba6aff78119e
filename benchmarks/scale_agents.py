"""Simulated torchrun agents for rendezvous benchmarks: hundreds of real handlers per process.

    python benchmarks/scale_agents.py --backend lease --endpoints 127.0.0.1:2379 --run-id r1 \\
        --agents 256 --min-nodes 256 --max-nodes 256        # then JSON commands on stdin

Each simulated agent is a real rendezvous handler -- ``LeaseRendezvousHandler`` (``lease``) or
torch's ``DynamicRendezvousHandler`` over a TCPStore (``c10d``) -- with its own lease or heartbeats, driven like torchrun's agent drives it: a thread
per agent calls ``next_rendezvous()``, and after each round a monitor calls
``num_nodes_waiting()`` every ``--monitor-interval`` seconds (torchrun's default, 0.1 s) and makes
the agent join again when it is non-zero (as torchrun restarts its workers). No workers run.

What a process shares among its agents, and why the figures still hold for N machines:

* ``lease``: one ``EtcdConnection`` (one gRPC channel, so one TCP connection, to one
  home member for reads and streams, and one to the leader for writes; processes are spread over
  the members). gRPC multiplexes calls on them, so no agent waits for another's request; the
  lookup of the leader (one ``Status``) is shared by the process's agents. Each agent still sends
  its own requests, holds its own lease and its own etcd watchers; etcd does the same work per
  agent as for one agent per
  machine. The lease keep-alives of a process travel on one stream (``LeaseKeeper``), as they
  would on each machine's own stream: one message per lease and renewal either way.
* ``c10d``: each agent has its own TCPStore client connection, like a torchrun agent.
* The CPU: all agents and etcd members share this machine's cores. Client-side Python time is
  therefore part of every measured latency here (a real node spends it on its own core), which
  makes these figures an upper bound; the CPU each side used is reported separately.

Commands (one JSON object per line; each is answered by one JSON line):
``{"cmd": "join", "agents": [i, ...]}`` start ``next_rendezvous`` on those agents (indices local
to the process); ``{"cmd": "restart", "agents": [...]}`` join again now (their workers "failed");
``{"cmd": "kill", "agents": [...]}`` stop them without a goodbye (keep-alives or heartbeats stop,
as on SIGKILL); ``{"cmd": "leave", "agents": [...]}`` leave gracefully (lease revoked, as on
SIGTERM); ``{"cmd": "spawn", "count": n}`` add agents; ``{"cmd": "report"}`` the records, errors,
request counts and this process's CPU seconds; ``{"cmd": "quit"}``.

:class:`Fleet` starts and drives such processes from a benchmark or a test.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

BACKENDS = ("lease", "c10d")
# torch's dynamic-handler timings for the c10d agents (the values every recorded run used).
C10D_CLOSE_TIMEOUT_S = 30
C10D_HEARTBEAT_TIMEOUT_S = 30
C10D_KEEP_ALIVE_INTERVAL_S = 5
C10D_KEEP_ALIVE_MAX_ATTEMPT = 3
SCRIPT = Path(__file__).resolve()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux ``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- inside a simulation process -------------------------------------------------------------------


@dataclass
class Agent:
    """One simulated node: a handler, the thread that drives it, what happened to it."""

    index: int
    handler: Any
    alive: bool = True
    want_join: threading.Event = field(default_factory=threading.Event)
    joining: bool = False
    records: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


class Simulation:
    """The agents of one process and the shared connection(s) they use."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.agents: list[Agent] = []
        self.connection: Any = None
        self._lock = threading.Lock()
        if args.backend == "lease":
            from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints

            endpoints = parse_endpoints(args.endpoints)
            shift = args.process_index % len(endpoints)  # spread the processes over the members
            self.connection = EtcdConnection(
                EtcdClientConfig(
                    endpoints=endpoints[shift:] + endpoints[:shift],
                    read_timeout=10,
                    retry_timeout=args.retry_timeout,
                )
            )
        self.spawn(args.agents)
        threading.Thread(target=self._monitor, name="monitor", daemon=True).start()

    def _settings(self) -> Any:
        from rendezvous.settings import settings_from_conf

        return settings_from_conf(
            self.args.conf,
            endpoint=self.args.endpoints,
            run_id=self.args.run_id,
            min_nodes=self.args.min_nodes,
            max_nodes=self.args.max_nodes,
            local_addr="127.0.0.1",
        )

    def _make_handler(self) -> Any:
        settings = self._settings()
        if self.args.backend == "lease":
            from rendezvous.lease_handler import LeaseRendezvousHandler

            return LeaseRendezvousHandler(self.connection, settings)
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

        timeout = RendezvousTimeout(
            timedelta(seconds=settings.join_timeout),
            timedelta(seconds=settings.last_call_timeout),
            timedelta(seconds=C10D_CLOSE_TIMEOUT_S),
            timedelta(seconds=C10D_HEARTBEAT_TIMEOUT_S),
        )
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

        host, _, port = self.args.store.rpartition(":")
        client = dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=settings.join_timeout)
        )
        backend_c10d = C10dRendezvousBackend(client, settings.run_id)
        return DynamicRendezvousHandler.from_backend(
            settings.run_id,
            client,
            backend_c10d,
            settings.min_nodes,
            settings.max_nodes,
            "127.0.0.1",
            timeout,
            keep_alive_interval=C10D_KEEP_ALIVE_INTERVAL_S,
            keep_alive_max_attempt=C10D_KEEP_ALIVE_MAX_ATTEMPT,
        )

    def spawn(self, count: int) -> list[int]:
        added = []
        for _ in range(count):
            agent = Agent(len(self.agents), self._make_handler())
            with self._lock:
                self.agents.append(agent)
            threading.Thread(
                target=self._drive, args=(agent,), name=f"agent-{agent.index}", daemon=True
            ).start()
            added.append(agent.index)
        return added

    def _drive(self, agent: Agent) -> None:
        while True:
            agent.want_join.wait()
            if not agent.alive:
                return
            agent.joining = True
            entered = time.monotonic()
            try:
                info = agent.handler.next_rendezvous()
            except Exception as exc:
                if agent.alive:
                    agent.error = f"{type(exc).__name__}: {exc}"
                agent.joining = False
                return
            released = time.monotonic()
            agent.records.append(
                {
                    "entered": entered,
                    "released": released,
                    "rank": info.rank,
                    "world_size": info.world_size,
                    "round": getattr(agent.handler, "_round", None),
                }
            )
            agent.want_join.clear()
            agent.joining = False

    def _monitor(self) -> None:
        """torchrun's monitor loop: a restart when the handler says nodes are waiting."""
        interval = self.args.monitor_interval
        while True:
            started = time.monotonic()
            with self._lock:
                agents = list(self.agents)
            for agent in agents:
                if (
                    agent.alive
                    and agent.records
                    and not agent.joining
                    and not agent.want_join.is_set()
                ):
                    try:
                        if agent.handler.num_nodes_waiting() > 0:
                            agent.want_join.set()
                    except Exception as exc:  # reported with the agent
                        agent.error = f"num_nodes_waiting: {type(exc).__name__}: {exc}"
            time.sleep(max(0.0, interval - (time.monotonic() - started)))

    def join(self, indices: Sequence[int]) -> None:
        for i in indices:
            self.agents[i].want_join.set()

    def kill(self, indices: Sequence[int]) -> None:
        """As SIGKILL: the agent stops, its lease or heartbeats are left to expire."""
        for i in indices:
            agent = self.agents[i]
            agent.alive = False
            handler = agent.handler
            if self.args.backend == "lease":
                lease = handler._lease.current()
                if lease is not None:
                    handler._lease._keeper.forget(lease)
                handler._slot.stop()  # its coordinator (if any) dies with it
                handler._watch.cancel()
                handler._finalizer.detach()
            else:
                handler._stop_heartbeats()
            agent.want_join.set()

    def leave(self, indices: Sequence[int]) -> None:
        """As SIGTERM under torchrun: the launcher exits and its lease is revoked on the way."""
        for i in indices:
            agent = self.agents[i]
            agent.alive = False
            if self.args.backend == "lease":
                agent.handler.leave()
            else:  # torch's dynamic handler says no goodbye: its heartbeats stop
                agent.handler._stop_heartbeats()
            agent.want_join.set()

    def progress(self, indices: Sequence[int], since: float) -> dict[str, Any]:
        """How many of ``indices`` completed a round after ``since`` (a monotonic time), and
        the first errors."""
        done, errors = 0, []
        for i in indices:
            agent = self.agents[i]
            done += any(r["released"] > since for r in agent.records)
            if agent.error:
                errors.append(agent.error)
        return {"done": done, "errors": errors[:3], "failed": len(errors)}

    def report(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        requests = 0
        if self.connection is not None:
            counts = dict(self.connection.request_counts)
            requests = self.connection.requests
        extra: dict[str, Any] = {}
        if self.args.backend == "lease" and self.agents:
            from rendezvous.lease_keeper import LeaseKeeper
            from rendezvous.watch_hub import WatchHub

            extra = {
                "watch_events": WatchHub.of(self.connection).events,
                "leases_kept": LeaseKeeper.of(self.connection).kept(),
                "coordinators": [
                    a.index for a in self.agents if a.handler._coordinator is not None
                ],
            }
        return {
            "ok": True,
            "pid": os.getpid(),
            "cpu_s": cpu_seconds(os.getpid()),
            "requests": requests,
            "request_counts": counts,
            **extra,
            "agents": [
                {
                    "index": a.index,
                    "alive": a.alive,
                    "records": a.records,
                    "error": a.error,
                    "node": getattr(a.handler, "node_id", None),
                }
                for a in self.agents
            ],
        }


def _dump_state(signum: int, frame: Any) -> None:
    """(SIGUSR1) Every thread's stack and every watch stream's state, into this process's log."""
    from rendezvous import watch_hub

    faulthandler.dump_traceback(all_threads=True)
    for state in watch_hub.describe_all():
        print(f"watch hub: {state}", file=sys.stderr, flush=True)


def serve(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    threading.stack_size(512 * 1024)  # a thousand agent threads: keep their stacks small
    logging.basicConfig(
        level=logging.ERROR if args.quiet else logging.WARNING,
        format=f"[sim {args.process_index}] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.quiet:  # one coordinator per run: its decisions too (a line per round or loss)
        for name in (
            "rendezvous.coordinator",
            "rendezvous.watch_hub",
        ):  # and each stream that failed over
            logging.getLogger(name).setLevel(logging.INFO)
    signal.signal(
        signal.SIGUSR1, _dump_state
    )  # a stalled round: stacks and watch streams into the log
    simulation = Simulation(args)
    print(json.dumps({"ok": True, "ready": len(simulation.agents), "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        name = command["cmd"]
        reply: dict[str, Any] = {"ok": True}
        if name == "join" or name == "restart":
            simulation.join(command["agents"])
        elif name == "kill":
            simulation.kill(command["agents"])
        elif name == "leave":
            simulation.leave(command["agents"])
        elif name == "spawn":
            reply["agents"] = simulation.spawn(command["count"])
        elif name == "report":
            reply = simulation.report()
        elif name == "progress":
            reply.update(simulation.progress(command["agents"], command["since"]))
        elif name == "quit":
            for agent in simulation.agents:
                if agent.alive and hasattr(agent.handler, "leave"):
                    agent.handler.leave()
            print(json.dumps(reply), flush=True)
            os._exit(0)  # agent threads may be blocked in next_rendezvous
        else:
            reply = {"ok": False, "error": f"unknown command {name!r}"}
        print(json.dumps(reply), flush=True)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="simulated rendezvous agents (one process)")
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--endpoints", default="", help="etcd endpoints (lease)")
    parser.add_argument("--store", default="", help="host:port of the TCPStore (c10d)")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--agents", type=int, required=True)
    parser.add_argument("--process-index", type=int, default=0)
    parser.add_argument("--min-nodes", type=int, required=True)
    parser.add_argument("--max-nodes", type=int, required=True)
    parser.add_argument("--conf", default="", help="--rdzv-conf of every agent")
    parser.add_argument("--retry-timeout", type=float, default=20.0)
    parser.add_argument("--monitor-interval", type=float, default=0.1)
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="log errors only (else warnings, and the coordinator's decisions)",
    )
    return parser.parse_args(argv)


# -- the driver side -------------------------------------------------------------------------------


class AgentProcess:
    """One simulation process, driven over its stdin/stdout."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 -- lives as long as the process
        self.process = subprocess.Popen(
            [sys.executable, str(SCRIPT), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {})},
            text=True,
            bufsize=1,
        )
        self._reply_lock = threading.Lock()
        self.ready: dict[str, Any] | None = None

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        self.ready = self._read(timeout)
        return self.ready

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        result: list[str] = []
        reader = threading.Thread(
            target=lambda: result.append(self.process.stdout.readline()), daemon=True
        )  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not result or not result[0]:
            raise TimeoutError(
                f"simulation process {self.process.pid} gave no answer within {timeout:g}s "
                f"(exit {self.process.poll()}); see {self.log_path}"
            )
        return json.loads(result[0])  # type: ignore[no-any-return]

    def ask(self, command: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        with self._reply_lock:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
            reply = self._read(timeout)
        if not reply.get("ok"):
            raise RuntimeError(f"simulation process {self.process.pid}: {reply}")
        return reply

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(TimeoutError, RuntimeError, OSError, ValueError):
                self.ask({"cmd": "quit"}, timeout=15)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        self._log.close()


@dataclass(frozen=True)
class AgentRef:
    """An agent of a :class:`Fleet`: its process and its index there."""

    process: int
    index: int


class Fleet:
    """N simulated agents spread over processes of at most ``per_process`` agents each.

    Args:
        conf: the ``--rdzv-conf`` of every agent.
        endpoints: etcd endpoints (``lease``); ``store``: the TCPStore (``c10d``).
    """

    def __init__(
        self,
        *,
        backend: str,
        agents: int,
        min_nodes: int,
        max_nodes: int,
        run_id: str | None = None,
        endpoints: str = "",
        store: str = "",
        conf: str = "",
        per_process: int = 1250,
        log_dir: Path,
        retry_timeout: float = 20.0,
        quiet: bool = True,
    ) -> None:
        self.backend, self.run_id = backend, run_id or f"scale-{uuid.uuid4().hex[:8]}"
        self.endpoints, self.conf = endpoints, conf
        processes = max(1, math.ceil(agents / per_process))
        sizes = [
            agents // processes + (1 if i < agents % processes else 0) for i in range(processes)
        ]
        self.processes: list[AgentProcess] = []
        self.refs: list[AgentRef] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        for i, size in enumerate(sizes):
            argv = [
                "--backend",
                backend,
                "--endpoints",
                endpoints,
                "--store",
                store,
                "--run-id",
                self.run_id,
                "--agents",
                str(size),
                "--process-index",
                str(i),
                "--min-nodes",
                str(min_nodes),
                "--max-nodes",
                str(max_nodes),
                "--conf",
                conf,
                "--retry-timeout",
                str(retry_timeout),
            ]
            if quiet:
                argv.append("--quiet")
            self.processes.append(
                AgentProcess(
                    argv, log_dir / f"{backend}-{self.run_id}-{i}.log", env={"OMP_NUM_THREADS": "1"}
                )
            )
            self.refs += [AgentRef(i, j) for j in range(size)]

    def __enter__(self) -> Fleet:
        try:
            for process in self.processes:
                process.wait_ready(300)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for process in self.processes:
            process.stop()

    def pids(self) -> list[int]:
        return [p.process.pid for p in self.processes]

    def _by_process(self, refs: Sequence[AgentRef]) -> Iterator[tuple[AgentProcess, list[int]]]:
        grouped: dict[int, list[int]] = {}
        for ref in refs:
            grouped.setdefault(ref.process, []).append(ref.index)
        for i, indices in grouped.items():
            yield self.processes[i], indices

    def command(self, name: str, refs: Sequence[AgentRef]) -> None:
        """Send ``join``/``restart``/``kill``/``leave`` to the processes of ``refs`` (in parallel)."""
        threads = [
            threading.Thread(target=p.ask, args=({"cmd": name, "agents": idx},))
            for p, idx in self._by_process(refs)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)

    def spawn(self, count: int, process: int = 0) -> list[AgentRef]:
        reply = self.processes[process].ask({"cmd": "spawn", "count": count}, timeout=300)
        refs = [AgentRef(process, i) for i in reply["agents"]]
        self.refs += refs
        return refs

    def reports(self) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = [{} for _ in self.processes]

        def one(i: int) -> None:
            results[i] = self.processes[i].ask({"cmd": "report"}, timeout=300)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(self.processes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        return results

    def wait_released(
        self, refs: Sequence[AgentRef], since: float, timeout: float, poll: float = 0.2
    ) -> None:
        """Wait until every agent of ``refs`` has completed a round after ``since`` (monotonic).

        Raises:
            TimeoutError: not all of them within ``timeout`` seconds.
            RuntimeError: an agent failed.
        """
        deadline = time.monotonic() + timeout
        groups = list(self._by_process(refs))
        while True:
            done, errors, by_process = 0, [], []
            for process, indices in groups:
                reply = process.ask({"cmd": "progress", "agents": indices, "since": since})
                done += reply["done"]
                errors += reply["errors"]
                by_process.append(f"{reply['done']}/{len(indices)}")
            if done == len(refs):
                return
            if errors:
                raise RuntimeError(f"agent(s) failed: {errors[0]}")
            if time.monotonic() > deadline:
                for (
                    process,
                    _,
                ) in groups:  # every thread's stack into the process's log, for the post-mortem
                    with contextlib.suppress(OSError):
                        process.process.send_signal(signal.SIGUSR1)
                raise TimeoutError(
                    f"{done} of {len(refs)} agents completed a round within {timeout:g}s "
                    f"(by process: {', '.join(by_process)}; stacks in the logs)"
                )
            time.sleep(poll)

    def releases(
        self, reports: list[dict[str, Any]], refs: Sequence[AgentRef], since: float
    ) -> list[float]:
        """Seconds from ``since`` to each agent's first release after it (from :meth:`reports`)."""
        wanted = {(r.process, r.index) for r in refs}
        out = []
        for p, report in enumerate(reports):
            for agent in report["agents"]:
                if (p, agent["index"]) in wanted:
                    after = [r["released"] for r in agent["records"] if r["released"] > since]
                    if after:
                        out.append(min(after) - since)
        return out


if __name__ == "__main__":
    serve(sys.argv[1:])
