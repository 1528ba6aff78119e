"""``elastic-trainer demo``: two nodes on this machine, a real etcd, real faults, and the recovery.

    elastic-trainer demo                 # about 90 s
    elastic-trainer demo --max-steps 300 # shorter
    elastic-trainer demo --sharded       # the same faults on an FSDP2 model (sharded_lm)

It starts a standalone etcd and node ``a`` (``elastic-trainer run --nnodes 1:2``, two workers) on
the example job, then, at fixed fractions of the run: node ``b`` joins (the group grows to four
workers), a worker of node ``a`` is SIGKILLed (the group heals from the just-in-time checkpoint),
and node ``b`` leaves with SIGTERM (a scale-down: it checkpoints and the group shrinks). Nothing is
staged: the faults are real signals to real processes, and every figure in the closing summary is
read from the workers' own sample records (``--record-samples``) and checkpoints. The nodes' full
logs go to ``<dir>/logs``; the console shows the demo's narrative and the nodes' key lines.

``--sharded`` runs the same scenario on ``sharded_lm`` (a transformer under FSDP2, its own loop
over ``ElasticGroup`` attempts): the worker SIGKILL heals in place, the lost rank's shards coming
from its neighbour's host copy (0 steps lost); a join or a leave changes the world size, and the
shards held in memory are cut into those of the new world (resharded in place, no checkpoint
read); where some shard has no copy left, the group goes on from the newest sharded checkpoint,
resharded (the summary counts the steps redone either way).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from elastic_trainer.ops.processes import NodeProcess, start_process, wait_for
from elastic_trainer.runtime.sample_log import (
    Generation,
    committed_history,
    generations,
    read_records,
)
from rendezvous.etcd_server import EtcdServer, free_port

PROG = "elastic-trainer demo"
SHOWN = (
    "INFO elastic_trainer.train.loop: step ",
    "restarting the worker group",
    "resumed from",
    "received SIGTERM",
    "job failed",
    "training finished",
    "error:",
    "node metrics on",
    "waiting for nodes",
)
"""Node output lines echoed to the console (everything goes to the node's log file)."""
SHARDED_CHECKPOINT_EVERY = 20
"""``--sharded``: steps between periodic checkpoints (a SIGKILL redoes at most this many)."""
STOP_GRACE_S = 40.0
"""How long a node may take to stop after SIGTERM at the end before it is killed."""


@dataclass(kw_only=True, slots=True)
class DemoSettings:
    """The demo's knobs (the command-line options of the same names)."""

    max_steps: int = 1200
    """Optimizer steps in all; the faults come at fixed fractions of it."""
    throttle_ms: float = 45.0
    """Sleep after every step, so the run lasts long enough to watch."""
    directory: Path = Path("runs/demo")
    """Checkpoints, sample records and logs go here (cleared at start)."""
    metrics_port: int = 9400
    """Node a's metrics port; node b uses the next one. 0: metrics off."""
    sharded: bool = False
    """Train ``sharded_lm`` (FSDP2) instead of ``synthetic_cnn`` (DDP): a lost worker heals in
    place from its neighbour's copy of its shards; a new world size is resharded in place from
    the shards and copies in memory (the newest sharded checkpoint where a shard is gone)."""

    def __post_init__(self) -> None:
        if self.max_steps < 100:
            raise ValueError(
                f"--max-steps: at least 100 (the faults need room), got {self.max_steps}"
            )
        if self.throttle_ms < 0:
            raise ValueError(f"--throttle-ms: must be >= 0, got {self.throttle_ms}")
        if not 0 <= self.metrics_port <= 65534:
            raise ValueError(f"--metrics-port: must be 0..65534, got {self.metrics_port}")


@dataclass
class FaultRecord:
    """One fault and how the job came back from it."""

    name: str
    at_unix: float
    at_step: int
    recovered_s: float | None = None
    steps_lost: int | None = None


@dataclass
class Node:
    """One ``elastic-trainer run`` process, its output in its log file, key lines echoed."""

    name: str
    process: NodeProcess
    echo: Callable[[str], None]
    stopping: bool = False
    """The demo signalled it to stop: its exit is expected."""
    _last: tuple[str, float] = ("", 0.0)
    _echoing: threading.Thread | None = field(default=None, repr=False)

    def start_echo(self) -> None:
        self._echoing = threading.Thread(target=self._follow, name=f"node-{self.name}", daemon=True)
        self._echoing.start()

    def finish_echo(self, timeout: float = 5.0) -> None:
        """Wait until the lines the node wrote before it exited have been echoed."""
        if self._echoing is not None:
            self._echoing.join(timeout)

    def _follow(self) -> None:
        """Reader thread: follows the log file until the node has exited and all of it is read."""
        with open(self.process.log_path, encoding="utf-8", errors="replace") as log:
            log.readline()  # the command line start_process wrote: the log's, not the console's
            partial = ""
            while True:
                exited = self.process.poll() is not None  # before reading: nothing comes after it
                chunk = log.readline()
                if chunk.endswith("\n"):
                    self._show(partial + chunk)
                    partial = ""
                elif chunk:
                    partial += chunk  # the rest of the line is still being written
                elif exited:
                    if partial:
                        self._show(partial)
                    return
                else:
                    time.sleep(0.1)

    def _show(self, line: str) -> None:
        if any(marker in line for marker in SHOWN):
            short = _short(line.rstrip())
            message = short.split(": ", 1)[-1]
            now = time.monotonic()
            if message == self._last[0] and now - self._last[1] < 2.0:
                return  # every rank says it: once is enough on the console
            self._last = (message, now)
            self.echo(f"[node {self.name}] {short}")


_RUNTIME_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ \[rank (\d+)\] [A-Z]+ [\w.]+: (.*)$")


def _short(line: str) -> str:
    """``rank R: message`` for a runtime log line (timestamp, level and logger dropped)."""
    match = _RUNTIME_LINE.match(line)
    return f"rank {match.group(1)}: {match.group(2)}" if match else line


class Demo:
    """Runs the scenario; see the module docstring."""

    def __init__(self, settings: DemoSettings, *, out: IO[str] = sys.stdout) -> None:
        self.settings = settings
        self.out = out
        self.dir = settings.directory.resolve()
        self.samples = self.dir / "samples"
        self.checkpoints = self.dir / "checkpoints"
        self.logs = self.dir / "logs"
        self.nodes: dict[str, Node] = {}
        self.faults: list[FaultRecord] = []
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        with self._lock:
            print(text, file=self.out, flush=True)

    # -- processes ---------------------------------------------------------------------------------
    def start_node(self, name: str, endpoint: str, run_id: str, port: int) -> Node:
        s = self.settings
        cmd = [
            sys.executable,
            "-m",
            "elastic_trainer.cli",
            "run",
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "2",
            "--device",
            "cpu",
            "--rdzv-endpoint",
            endpoint,
            "--run-id",
            run_id,
            "--metrics-port",
            str(port),
            "--metrics-addr",
            "127.0.0.1",
            "--max-restarts",
            "5",
            *self._job(),
            "--max-steps",
            str(s.max_steps),
            "--epochs",
            "1000",
            "--checkpoint-dir",
            str(self.checkpoints),
            "--seed",
            "0",
            "--throttle-ms",
            str(s.throttle_ms),
            "--record-samples",
            str(self.samples),
            "--log-every",
            "50",
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        node = Node(name, start_process(cmd, self.logs / f"node-{name}.log", env), self.say)
        self.nodes[name] = node
        node.start_echo()
        return node

    def _job(self) -> list[str]:
        """The launcher's healing mode, the example and its own arguments."""
        if self.settings.sharded:
            return [
                "-m",
                "elastic_trainer.examples.sharded_lm",
                "--api",
                "loop",
                "--global-batch-size",
                "24",
                "--checkpoint-every",
                str(SHARDED_CHECKPOINT_EVERY),
            ]
        return [
            "-m",
            "elastic_trainer.examples.synthetic_cnn",
            "--global-batch-size",
            "64",
            "--checkpoint-every",
            "100",
        ]

    def stop_all(self) -> None:
        """SIGTERM every node still running, give them :data:`STOP_GRACE_S` together, then kill
        whatever is left of them (workers included)."""
        for node in self.nodes.values():
            node.process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for node in self.nodes.values():
            with contextlib.suppress(TimeoutError):
                node.process.wait(max(0.1, deadline - time.monotonic()))
            node.process.stop()

    # -- progress, read from the workers' own records -------------------------------------------------
    def generations(self) -> list[Generation]:
        return generations(self.samples)

    def step(self) -> int:
        return max((g.last_step for g in self.generations()), default=0)

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 180.0) -> None:
        """Wait for ``condition``; a node that fails meanwhile or the timeout ends the demo.

        Raises:
            RuntimeError: one line naming what failed and where the logs are.
        """

        def done() -> bool:
            if condition():
                return True
            for node in self.nodes.values():
                code = node.process.poll()
                if code not in (None, 0) and not node.stopping:
                    raise RuntimeError(
                        f"node {node.name} exited with {code} while waiting for {what}; "
                        f"see {self.logs}"
                    )
            return False

        try:
            wait_for(done, timeout=timeout, what=what)
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}; see {self.logs}") from exc

    def measure(self, fault: FaultRecord, before: int) -> None:
        """Recovery of ``fault``: a new generation's first completed step after it; steps lost."""

        def recovered() -> Generation | None:
            for gen in self.generations()[before:]:
                if gen.started_unix >= fault.at_unix - 1 and any(
                    t > fault.at_unix for t in gen.done_times.values()
                ):
                    return gen
            return None

        self.wait_until(lambda: recovered() is not None, f"recovery from: {fault.name}")
        gen = recovered()
        if gen is None:  # wait_until saw it; a generation does not disappear from the logs
            raise RuntimeError(
                f"recovery from {fault.name} was seen, then not found in the sample logs"
            )
        first = min(t for t in gen.done_times.values() if t > fault.at_unix)
        fault.recovered_s = first - fault.at_unix
        previous = self.generations()[before - 1] if before > 0 else None
        fault.steps_lost = max(0, previous.last_step - gen.resumed_step) if previous else 0
        self.say(
            f"[demo]   recovered: step {gen.resumed_step + 1} done {fault.recovered_s:.1f} s after the fault, "
            f"world of {gen.world_size} workers, {fault.steps_lost} step(s) lost"
        )

    # -- the scenario -------------------------------------------------------------------------------
    def run(self) -> int:
        """Set up, play the scenario, and always stop the nodes and etcd."""
        s = self.settings
        for sub in (self.samples, self.checkpoints, self.logs):
            if sub.exists():
                shutil.rmtree(sub)
            sub.mkdir(parents=True)
        ports = _ports(s.metrics_port)
        self.say(
            f"{PROG}: 2 nodes x 2 workers on this machine, a real etcd, real faults; "
            f"{s.max_steps} steps (--max-steps shortens it)"
        )
        etcd = EtcdServer.single(self.dir / "etcd")
        etcd.start()
        try:
            return self.scenario(etcd.endpoint, f"demo-{os.getpid()}", ports)
        finally:
            self.stop_all()
            etcd.stop()
            shutil.rmtree(self.dir / "etcd", ignore_errors=True)

    def scenario(self, endpoint: str, run_id: str, ports: tuple[int, int]) -> int:
        """Node a, then the join, the worker SIGKILL and the leave, each measured; the summary."""
        s = self.settings
        self.say(f"[demo] etcd on {endpoint}; run id {run_id}; checkpoints in {self.checkpoints}")
        if ports[0]:
            self.say(
                f"[demo] live view: elastic-trainer top --url http://127.0.0.1:{ports[0]}/metrics "
                f"--url http://127.0.0.1:{ports[1]}/metrics   (in another terminal)"
            )
        if s.sharded:
            self.say(
                "[demo] sharded: sharded_lm under FSDP2 (each worker holds and checkpoints "
                "its own shards, and keeps a copy of its neighbour's); a lost worker heals in "
                "place from that copy, and a new world size is resharded in place from the "
                "shards and copies in memory"
            )
        self.say("[demo] node a starts (elastic: 1 to 2 nodes, 2 workers each)")
        self.start_node("a", endpoint, run_id, ports[0])
        join_at, kill_at, leave_at = (int(s.max_steps * f) for f in (0.15, 0.45, 0.70))

        before = self.reach(join_at)
        join = self.fault("node b joins (scale-up)")
        self.say(f"[demo] node b joins at step {join.at_step}")
        self.start_node("b", endpoint, run_id, ports[1])
        self.measure(join, before)

        before = self.reach(kill_at)
        self.measure(self.kill_worker(), before)

        before = self.reach(leave_at)
        leave = self.fault("node b leaves (SIGTERM, scale-down)")
        self.say(f"[demo] SIGTERM node b at step {leave.at_step} (preemption / scale-down)")
        self.nodes["b"].stopping = True
        self.nodes["b"].process.terminate()
        self.measure(leave, before)

        self.wait_until(
            lambda: self.nodes["a"].process.poll() is not None,
            "the end of training",
            timeout=600,
        )
        code = self.nodes["a"].process.wait(10)
        self.nodes["a"].finish_echo()
        self.summary(code, ports)
        return 0 if code == 0 else 1

    def reach(self, step: int) -> int:
        """Wait for ``step``; returns the generations so far (the recovery is a later one)."""
        self.wait_until(lambda: self.step() >= step, f"step {step}")
        return len(self.generations())

    def fault(self, name: str) -> FaultRecord:
        """A fault that starts now, at the current step, kept for the summary."""
        record = FaultRecord(name, time.time(), self.step())
        self.faults.append(record)
        return record

    def kill_worker(self) -> FaultRecord:
        """SIGKILL a worker of node a (rank 1 when it is there) in the newest generation."""
        newest = self.generations()[-1]
        rank = 1 if 1 in newest.pids else min(newest.pids)
        kill = self.fault(f"worker SIGKILL (rank {rank}, node a)")
        self.say(
            f"[demo] SIGKILL worker rank {rank} (pid {newest.pids[rank]}) at step {kill.at_step}"
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(newest.pids[rank], signal.SIGKILL)
        return kill

    def summary(self, code: int, ports: Sequence[int]) -> None:
        history = committed_history(read_records(self.samples))
        steps_once = sorted(history) == list(range(1, self.settings.max_steps + 1))
        by_epoch: dict[int, list[int]] = {}
        for records in history.values():
            for record in records:
                by_epoch.setdefault(record["epoch"], []).extend(record["indices"])
        repeated = sum(len(indices) - len(set(indices)) for indices in by_epoch.values())
        newest = sorted([*self.checkpoints.glob("ckpt-*.pt"), *self.checkpoints.glob("ckpt-*.dcp")])
        self.say("")
        self.say(f"{PROG}: summary")
        self.say(f"  {'fault':<38} {'recovered in':>12}  {'steps lost':>10}")
        for fault in self.faults:
            recovered = "-" if fault.recovered_s is None else f"{fault.recovered_s:.1f} s"
            lost = "-" if fault.steps_lost is None else str(fault.steps_lost)
            self.say(f"  {fault.name:<38} {recovered:>12}  {lost:>10}")
        self.say(
            f"  training: {'finished' if code == 0 else f'FAILED (exit {code})'}, {len(history)} steps "
            f"committed ({'each once' if steps_once else 'NOT each once'}), "
            f"{sum(len(v) for v in by_epoch.values())} samples, {repeated} seen twice within an epoch"
        )
        if newest:
            self.say(f"  checkpoints: {self.checkpoints} (newest {newest[-1].name})")
        if ports[0]:
            self.say(
                f"  metrics were served at http://127.0.0.1:{ports[0]}/metrics (node a) and "
                f"http://127.0.0.1:{ports[1]}/metrics (node b)"
            )
        self.say(f"  node logs: {self.logs}")


def _ports(first: int) -> tuple[int, int]:
    """Node a's and b's metrics ports: ``first`` and the next, or free ones if those are taken."""
    if first == 0:
        return 0, 0
    wanted = (first, first + 1)
    if all(_port_free(port) for port in wanted):
        return wanted
    return free_port(), free_port()


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = DemoSettings()
    parser.add_argument(
        "--max-steps",
        type=int,
        default=int(os.environ.get("MAX_STEPS", defaults.max_steps)),
        help=f"steps in all (default {defaults.max_steps}, or $MAX_STEPS)",
    )
    parser.add_argument(
        "--throttle-ms", type=float, default=defaults.throttle_ms, help="sleep after every step"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(os.environ.get("DEMO_DIR", str(defaults.directory))),
        help=f"where checkpoints and logs go (default {defaults.directory}, or $DEMO_DIR)",
    )
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="the same faults on an FSDP2 model (sharded_lm): heal in place from a neighbour's "
        "copy of the shards; a new world size is resharded in place from them",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("METRICS_PORT", defaults.metrics_port)),
        help="node a's metrics port, node b's is the next (0: off; default 9400 or $METRICS_PORT)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        settings = DemoSettings(
            max_steps=args.max_steps,
            throttle_ms=args.throttle_ms,
            directory=args.dir,
            metrics_port=args.metrics_port,
            sharded=args.sharded,
        )
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return Demo(settings).run()
    except RuntimeError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
