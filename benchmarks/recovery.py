"""Recovery after a fault: this project vs plain torchrun, side by side in one run.

    python -m benchmarks.recovery                                   # every scenario, both systems
    python -m benchmarks.recovery --scenarios worker-sigkill --modes elastic --repeats 3
    python -m benchmarks.recovery --systems etcd-v3 c10d c10d-unshared --json out.json
    python -m benchmarks.recovery --etcd-load 60 --systems etcd-v3 etcd-v3-restart   # etcd load, no fault
    python -m benchmarks.recovery --workload sharded --systems etcd-v3 etcd-v3-restart   # FSDP2

For each scenario a job of N nodes x P workers (separate launcher processes on this machine,
gloo, the example model) trains until step ``--fault-step``; then the fault is injected and the
benchmark measures

* **recovery**: seconds from the fault (for a join: from launching the new node) to the first
  step completed by a worker started after it;
* **steps lost**: the highest step completed before the fault minus the step training resumed
  from (work done again).

Systems: ``etcd-v3`` is ``elastic-trainer run`` (our launcher, the ``etcd-v3`` rendezvous on a
local etcd, the runtime and its checkpoints) running ``synthetic_cnn``, healing in place (its
default); ``etcd-v3-restart`` is the same with ``--heal off`` (every fault restarts every worker,
warm-started, from the newest checkpoint or the just-in-time one); ``c10d`` is plain
``torchrun --rdzv-backend=c10d`` running ``benchmarks/baseline_ddp_checkpoint.py`` (the same
model trained as the DDP guides write it, with their hand-written rank-0 checkpoint);
``c10d-unshared`` is the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the workaround for
torch 2.13's shared-store deadlock, see shared/notes). Each system runs with its defaults, as a
user would start it. Both checkpoint every ``--checkpoint-every`` steps and log the wall time
(``time.time()``) of every completed step; a run that has not recovered ``--recovery-timeout``
seconds after the fault is reported as "did not recover within T s" and stopped.

``--workload sharded`` trains ``sharded_lm`` (FSDP2, its own loop healing in place with the
neighbour copy, ``docs/design/sharded.md``) on the ``etcd-v3`` systems instead of the CNN, and
``--workload sharded-trainer`` the same model through the ``Trainer`` (``--api trainer``:
``TrainerConfig.fsdp``), and ``--workload sharded-hsdp`` the same model over a 2-replica HSDP
mesh (``--replicas 2``: 2 nodes x 2 workers are 2 replicas x 2 shards, a lost shard comes from
its replica); the c10d baseline script has no sharded twin, so ``etcd-v3-restart`` is
its comparison.

Scenarios: ``worker-sigkill`` (one worker of the last node), ``node-sigkill`` (the last node
vanishes: agent and workers SIGKILLed; in fixed-size mode a replacement node is started at
once, as an orchestrator would), ``node-sigterm`` (the last node is scaled down: its launcher
gets SIGTERM; elastic only), ``node-join`` (a second node joins a one-node job; elastic only),
``worker-sigstop`` (a worker of the last node frozen: alive, silent), ``hot-spare`` (one node
more than ``--nodes`` waits beyond the maximum, then the last full member is SIGKILLed; elastic
only), ``partition`` (the last node cut off from the others and from etcd: each node runs in its own
network namespace, etcd in a hub namespace, and the last node's link goes silent; elastic only;
needs ``ip netns`` as root, left out of the default scenarios otherwise).
Modes: ``fixed`` (``--nnodes N``) and ``elastic`` (``--nnodes 1:N``). The node killed is never the
first one, which hosts c10d's TCPStore (losing it ends a c10d job for good).

Prints a Markdown table with the ratios c10d / etcd-v3 (and writes ``--json``) first, then a
timeline chart (step vs seconds since the fault, rank 0) to ``--chart``. The chart needs
matplotlib (``pip install -e '.[bench]'``); without it the chart is skipped with one line and
nothing measured is lost. Ctrl-C stops the runs and still prints the table of those finished.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.netns import Network
from elastic_trainer.ops.processes import NodeProcess, start_process, wait_for

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

SYSTEMS = ("etcd-v3", "etcd-v3-restart", "c10d", "c10d-unshared")
WORKLOADS = {  # --workload -> the example the etcd-v3 systems run (module, then its own flags)
    "cnn": ("elastic_trainer.examples.synthetic_cnn",),
    "sharded": ("elastic_trainer.examples.sharded_lm",),
    "sharded-trainer": ("elastic_trainer.examples.sharded_lm", "--api", "trainer"),
    "sharded-hsdp": ("elastic_trainer.examples.sharded_lm", "--replicas", "2"),
}
SCENARIOS = {  # scenario -> the modes it makes sense in
    "worker-sigkill": ("fixed", "elastic"),
    "node-sigkill": ("fixed", "elastic"),
    "node-sigterm": ("elastic",),
    "node-join": ("elastic",),
    "worker-sigstop": ("fixed", "elastic"),
    "hot-spare": ("elastic",),
    "partition": ("elastic",),
}
NEEDS_ROOT = ("partition",)
BASELINE = HERE / "baseline_ddp_checkpoint.py"
JOINS_IN_PLACE = "this node's workers join it in place"
"""What a launcher logs once it is ready and joins a running job in place (``launch/in_place.py``)."""


# -- configuration ---------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """One benchmark run's settings (the command-line options of the same names)."""

    nodes: int = 2
    """Nodes at full size."""
    nproc_per_node: int = 2
    """Workers per node."""
    fault_step: int = 50
    """The fault fires once this step is completed."""
    checkpoint_every: int = 20
    """Steps between periodic checkpoints, both systems."""
    throttle_ms: float = 50.0
    """Sleep after every step (both systems): steps of a realistic length on a tiny model."""
    global_batch_size: int = 64
    dataset_size: int = 4096
    recovery_timeout: float = 90.0
    """Seconds after the fault before a run counts as not recovered."""
    steps_after: int = 10
    """Steps recorded after recovery before the run is stopped (for the chart)."""
    startup_timeout: float = 180.0
    workload: str = "cnn"
    """What the etcd-v3 systems train (:data:`WORKLOADS`); the c10d baseline trains the CNN only."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        for name in (
            "nodes",
            "nproc_per_node",
            "fault_step",
            "checkpoint_every",
            "global_batch_size",
            "dataset_size",
            "steps_after",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.nodes < 2:
            raise ValueError(f"nodes: at least 2 (a node is lost or joins), got {self.nodes}")
        for name in ("recovery_timeout", "startup_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {getattr(self, name)}")
        if self.throttle_ms < 0:
            raise ValueError(f"throttle_ms: must be >= 0, got {self.throttle_ms}")


@dataclass(slots=True)
class Outcome:
    """What one (scenario, mode, system) run measured."""

    scenario: str
    mode: str
    system: str
    recovered_s: float | None = None
    ready_s: float | None = None
    """node-join, in place: seconds from launching the new node to its launcher joining the running
    job (its warm server up, the placeholder round returned); ``recovered_s - ready_s`` is the join
    itself."""
    """Fault to the first step after recovery; ``None``: not within the timeout."""
    steps_lost: int | None = None
    last_step_before: int | None = None
    resumed_from: int | None = None
    error: str | None = None
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    """Rank 0's steps: (seconds since the fault, step, world size)."""


# -- nodes -----------------------------------------------------------------------------------------
class Cluster:
    """The node processes of one run, always stopped at exit."""

    def __init__(
        self,
        system: str,
        mode: str,
        cfg: BenchConfig,
        workdir: Path,
        etcd_endpoint: str,
        network: Network | None = None,
    ) -> None:
        """``network``: run node ``i`` in the namespace of ``n{i}`` (etcd is then the hub's)."""
        self.system, self.mode, self.cfg, self.workdir = system, mode, cfg, workdir
        self.records = workdir / "steps"
        self.run_id = f"recovery-{uuid.uuid4().hex[:8]}"
        self.etcd_endpoint = etcd_endpoint
        self.network = network
        from rendezvous.etcd_server import free_port

        self.c10d_port = free_port()
        self.c10d_host = "127.0.0.1" if network is None else network.address("n0")
        self.nodes: list[NodeProcess] = []

    @property
    def nnodes(self) -> str:
        return str(self.cfg.nodes) if self.mode == "fixed" else f"1:{self.cfg.nodes}"

    def command(self, index: int) -> tuple[list[str], dict[str, str]]:
        cfg = self.cfg
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        common = [
            "--global-batch-size",
            str(cfg.global_batch_size),
            "--dataset-size",
            str(cfg.dataset_size),
            "--checkpoint-every",
            str(cfg.checkpoint_every),
            "--throttle-ms",
            str(cfg.throttle_ms),
            "--seed",
            "0",
        ]
        if self.system in ("etcd-v3", "etcd-v3-restart"):
            heal = "in_place" if self.system == "etcd-v3" else "off"
            cmd = [
                sys.executable,
                "-m",
                "elastic_trainer.cli",
                "run",
                "--nnodes",
                self.nnodes,
                "--heal",
                heal,
                "--nproc-per-node",
                str(cfg.nproc_per_node),
                "--device",
                "cpu",
                "--rdzv-endpoint",
                self.etcd_endpoint,
                "--run-id",
                self.run_id,
                "--max-restarts",
                "10",
                "--metrics-port",
                "0",
                "-m",
                *WORKLOADS[cfg.workload],
                *common,
                "--epochs",
                "1000",
                "--checkpoint-dir",
                str(self.workdir / "ckpt"),
                "--record-samples",
                str(self.records),
                "--log-every",
                "1000",
            ]
            return cmd, env
        if self.system == "c10d-unshared":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        host = "true" if index == 0 else "false"  # the first node hosts the store, as in a real job
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.c10d_host}:{self.c10d_port}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf=is_host={host}",
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={cfg.nproc_per_node}",
            "--max-restarts=10",
            str(BASELINE),
            *common,
            "--max-steps",
            "1000000",
            "--checkpoint",
            str(self.workdir / "model.checkpoint"),
            "--record-steps",
            str(self.records),
        ]
        return cmd, env

    def start_node(self) -> None:
        index = len(self.nodes)
        cmd, env = self.command(index)
        if self.network is not None:
            name = f"n{index}"
            cmd = [
                *self.network.exec_prefix(name),
                *cmd,
            ]  # `ip netns exec` execs: the pid is the node's
            env.update(PET_LOCAL_ADDR=self.network.address(name), GLOO_SOCKET_IFNAME="eth0")
        self.nodes.append(start_process(cmd, self.workdir / f"node-{index}.log", env, cwd=REPO))

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()

    def tail(self) -> str:
        return "\n".join(f"--- {n.log_path.name} ---\n{n.tail(15)}" for n in self.nodes)


# -- records ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Process:
    """One worker process's records."""

    started_unix: float
    resumed_step: int
    rank: int
    steps: list[tuple[float, int, int]]  # (t, step, world size)


def read_processes(directory: Path) -> list[Process]:
    from elastic_trainer.runtime.sample_log import read_records

    if not directory.exists():
        return []
    found = []
    for records in read_records(directory):
        start = records[0]
        # The runtime records a step's completion ("done", with its time) after its "step" record
        # (no time: a process may have one before its first "done"); the baseline script writes
        # one time-stamped "step" record per completed step.
        done = [r for r in records[1:] if r.get("event") == "done"]
        step_records = done or [r for r in records[1:] if r.get("event") == "step" and "t" in r]
        if any("t" not in r for r in step_records):
            raise RuntimeError(f"step records without a time stamp in {directory}")
        steps = [(r["t"], r["step"], start["world_size"]) for r in step_records]
        found.append(Process(start["started_unix"], start["resumed_step"], start["rank"], steps))
    return found


def highest_step(processes: Sequence[Process]) -> int:
    return max((s for p in processes for _, s, _ in p.steps), default=0)


def analyse(outcome: Outcome, processes: list[Process], fault_unix: float) -> Outcome:
    """Fill in recovery time, steps lost and the rank-0 timeline (see the module docstring)."""
    before = [p for p in processes if p.started_unix < fault_unix]
    after = [p for p in processes if p.started_unix >= fault_unix and p.steps]
    outcome.last_step_before = highest_step(before)
    outcome.timeline = sorted(
        (t - fault_unix, s, w) for p in processes if p.rank == 0 for t, s, w in p.steps
    )
    if after:
        first = min(after, key=lambda p: p.steps[0][0])
        outcome.recovered_s = min(p.steps[0][0] for p in after) - fault_unix
        outcome.resumed_from = first.resumed_step
        outcome.steps_lost = max(0, outcome.last_step_before - first.resumed_step)
    return outcome


# -- one run ---------------------------------------------------------------------------------------
def run_one(
    scenario: str, mode: str, system: str, cfg: BenchConfig, workdir: Path, etcd_endpoint: str
) -> Outcome:
    """Start the job, inject the fault at ``fault_step``, measure, stop everything."""
    outcome = Outcome(scenario, mode, system)
    if scenario not in NEEDS_ROOT:
        return _run_cluster(outcome, Cluster(system, mode, cfg, workdir, etcd_endpoint))
    with Network([f"n{i}" for i in range(cfg.nodes)]) as network:
        return _run_cluster(
            outcome,
            Cluster(system, mode, cfg, workdir, network.start_etcd(workdir / "etcd"), network),
        )


def _run_cluster(outcome: Outcome, cluster: Cluster) -> Outcome:
    scenario, mode, system, cfg = outcome.scenario, outcome.mode, outcome.system, cluster.cfg
    try:
        for _ in range(1 if scenario == "node-join" else cfg.nodes):
            cluster.start_node()
        try:
            wait_for(lambda: highest_step(read_processes(cluster.records)) >= cfg.fault_step,
                     timeout=cfg.startup_timeout, what=f"step {cfg.fault_step}")  # fmt: skip
        except TimeoutError:
            outcome.error = (
                f"did not reach step {cfg.fault_step} within {cfg.startup_timeout:.0f} s"
            )
            print(f"  {system}: {outcome.error}\n{cluster.tail()}", file=sys.stderr)
            return outcome
        victim = cluster.nodes[-1]
        if scenario == "hot-spare":
            cluster.start_node()  # beyond --nodes: waits as a spare (torchrun: in the next round)
            spare = cluster.nodes[-1]
            if system == "etcd-v3":
                wait_for(
                    lambda: "waiting as a spare" in spare.output(),
                    timeout=cfg.startup_timeout,
                    what="the spare node to wait",
                )
            else:
                time.sleep(10.0)  # its agent has joined the waiting list by then
        fault_unix = time.time()
        if scenario == "worker-sigkill":
            victim.kill_worker(0)
        elif scenario == "worker-sigstop":
            os.kill(sorted(victim.worker_pids())[0], signal.SIGSTOP)
        elif scenario == "hot-spare":
            victim.kill_node()
        elif scenario == "node-sigkill":
            victim.kill_node()
            if mode == "fixed":
                cluster.start_node()  # the orchestrator's replacement
        elif scenario == "node-sigterm":
            victim.terminate()
        elif scenario == "partition":
            if cluster.network is None:
                raise ValueError("the partition scenario runs in network namespaces")
            cluster.network.partition(f"n{len(cluster.nodes) - 1}")
        elif scenario == "node-join":
            cluster.start_node()
            if system == "etcd-v3":
                newcomer = cluster.nodes[-1]
                with contextlib.suppress(TimeoutError):
                    wait_for(lambda: JOINS_IN_PLACE in newcomer.output(), timeout=cfg.recovery_timeout,
                             what="the new node's launcher to join", interval=0.02)  # fmt: skip
                    outcome.ready_s = time.time() - fault_unix
        else:
            raise ValueError(f"unknown scenario {scenario!r}")

        def recovered_enough() -> bool:
            after = [
                p
                for p in read_processes(cluster.records)
                if p.started_unix >= fault_unix and p.steps
            ]
            if not after:
                return False
            first = min(t for p in after for t, _, _ in p.steps)
            return highest_step(after) >= min(p.steps[0][1] for p in after) + cfg.steps_after or (
                time.time() - first > 10
            )

        with contextlib.suppress(TimeoutError):  # not recovered in time: analyse() reports it
            wait_for(recovered_enough, timeout=cfg.recovery_timeout, what="recovery")
        return analyse(outcome, read_processes(cluster.records), fault_unix)
    finally:
        cluster.stop()


# -- etcd load in steady state ----------------------------------------------------------------------
def etcd_messages(client_url: str) -> dict[str, float]:
    """gRPC messages etcd received so far, by method (``grpc_server_msg_received_total``: one per
    unary request, one per message of a stream: a lease keep-alive, a watch request)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{client_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "grpc_server_msg_received_total":
                method = f"{sample.labels['grpc_service'].rsplit('.', 1)[-1]}.{sample.labels['grpc_method']}"
                found[method] = found.get(method, 0.0) + sample.value
    return found


def measure_etcd_load(
    system: str, cfg: BenchConfig, workdir: Path, etcd_url: str, etcd_endpoint: str, window_s: float
) -> dict[str, object]:
    """Start ``cfg.nodes`` nodes (fixed size), let them train past ``fault_step``, then count what
    etcd receives over ``window_s`` seconds of healthy training; per node and minute."""
    cluster = Cluster(system, "fixed", cfg, workdir, etcd_endpoint)
    try:
        for _ in range(cfg.nodes):
            cluster.start_node()
        wait_for(lambda: highest_step(read_processes(cluster.records)) >= cfg.fault_step,
                 timeout=cfg.startup_timeout, what=f"step {cfg.fault_step}",
                 describe=cluster.tail)  # fmt: skip
        before, step_before, started = (
            etcd_messages(etcd_url),
            highest_step(read_processes(cluster.records)),
            time.monotonic(),
        )
        time.sleep(window_s)
        after, elapsed = etcd_messages(etcd_url), time.monotonic() - started
        steps = highest_step(read_processes(cluster.records)) - step_before
    finally:
        cluster.stop()
    scale = 60.0 / elapsed / cfg.nodes
    by_method = {
        m: round((after.get(m, 0.0) - before.get(m, 0.0)) * scale, 1) for m in sorted(after)
    }
    by_method = {m: v for m, v in by_method.items() if v > 0}
    return {
        "system": system,
        "nodes": cfg.nodes,
        "workers_per_node": cfg.nproc_per_node,
        "window_s": round(elapsed, 1),
        "steps": steps,
        "per_node_per_minute": round(sum(by_method.values()), 1),
        "by_method": by_method,
    }


def etcd_load_table(loads: Sequence[dict[str, object]]) -> str:
    methods = sorted({m for load in loads for m in load["by_method"]})  # type: ignore[attr-defined]
    lines = [
        "| system | steps in window | etcd messages per node per minute | "
        + " | ".join(methods)
        + " | at 1,000 nodes (messages/s) |",
        "|---|---:|---:|" + "---:|" * len(methods) + "---:|",
    ]
    for load in loads:
        per_node = float(load["per_node_per_minute"])  # type: ignore[arg-type]
        cells = [str(load["by_method"].get(m, 0)) for m in methods]  # type: ignore[attr-defined]
        lines.append(
            f"| {load['system']} | {load['steps']} | {per_node:.1f} | "
            + " | ".join(cells)
            + f" | {per_node * 1000 / 60:.0f} |"
        )
    return "\n".join(lines)


# -- report ----------------------------------------------------------------------------------------
def fmt_time(seconds: float | None, timeout: float) -> str:
    return f"did not recover within {timeout:.0f} s" if seconds is None else f"{seconds:.2f} s"


def summarise(outcomes: list[Outcome], systems: Sequence[str], timeout: float) -> str:
    """The Markdown table: median over repeats, ratio of each baseline to etcd-v3."""
    rows = []
    baselines = [s for s in systems if s != "etcd-v3"]
    header = ["scenario", "mode"]
    for system in systems:
        header += [f"{system} recovery s", f"{system} steps lost"]
    header += [f"{b} / etcd-v3" for b in baselines if "etcd-v3" in systems]
    rows.append("| " + " | ".join(header) + " |")
    rows.append("|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|")
    keys = list(dict.fromkeys((o.scenario, o.mode) for o in outcomes))
    for scenario, mode in keys:
        cells = [scenario, mode]
        medians: dict[str, float | None] = {}
        for system in systems:
            runs = [
                o for o in outcomes if (o.scenario, o.mode, o.system) == (scenario, mode, system)
            ]
            times = [o.recovered_s for o in runs]
            lost = [o.steps_lost for o in runs if o.steps_lost is not None]
            if not runs:
                medians[system] = None
                cells += ["-", "-"]
                continue
            ok = [t for t in times if t is not None]
            medians[system] = statistics.median(ok) if len(ok) == len(times) else None
            shown = (
                fmt_time(medians[system], timeout)
                if medians[system] is None
                else f"{medians[system]:.2f}"
            )
            if 0 < len(ok) < len(times):
                shown = f"{len(times) - len(ok)}/{len(times)} runs did not recover within {timeout:.0f} s"
            errors = [o.error for o in runs if o.error]
            cells += [errors[0] if errors else shown, str(statistics.median(lost)) if lost else "-"]
        for baseline in baselines:
            if "etcd-v3" not in systems:
                continue
            ours, theirs = medians.get("etcd-v3"), medians.get(baseline)
            if ours is None:
                cells.append("-")
            elif theirs is None:
                cells.append(f"> {timeout / ours:.1f}x")
            else:
                cells.append(f"{theirs / ours:.1f}x")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


NO_MATPLOTLIB = "no chart: matplotlib is not installed (pip install -e '.[bench]')"


def report(
    outcomes: list[Outcome],
    systems: Sequence[str],
    timeout: float,
    *,
    chart_path: Path,
    json_path: Path | None = None,
) -> None:
    """Print the table and write the JSON, then draw the chart: the table and the results never
    depend on the plot library, which only chart() imports."""
    print(summarise(outcomes, systems, timeout), flush=True)
    if json_path is not None:
        json_path.write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
        print(f"results: {json_path}", flush=True)
    if not outcomes:
        print("no chart: no run finished", file=sys.stderr)
        return
    if chart(outcomes, systems, timeout, chart_path):
        print(f"chart: {chart_path}")


def chart(outcomes: list[Outcome], systems: Sequence[str], timeout: float, path: Path) -> bool:
    """Step vs seconds since the fault, one panel per scenario/mode, one series per system (rank
    0, the first repeat). A system that did not recover is named in the legend only.

    Returns:
        False, after one line on stderr, when matplotlib cannot be imported (no chart drawn).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        missing = exc.name == "matplotlib"
        print(
            NO_MATPLOTLIB if missing else f"no chart: cannot import matplotlib ({exc})",
            file=sys.stderr,
        )
        return False

    keys = list(dict.fromkeys((o.scenario, o.mode) for o in outcomes))
    columns = 2
    rows = math.ceil(len(keys) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(12, 3.4 * rows), squeeze=False)
    colors = {
        "etcd-v3": "tab:blue",
        "etcd-v3-restart": "tab:green",
        "c10d": "tab:red",
        "c10d-unshared": "tab:orange",
    }
    window = 3.0  # seconds shown before the fault
    for ax, (scenario, mode) in zip(axes.flat, keys, strict=False):
        right, low = 5.0, None
        for system in systems:
            runs = [
                o for o in outcomes if (o.scenario, o.mode, o.system) == (scenario, mode, system)
            ]
            if not runs or not runs[0].timeline:
                continue
            run = runs[0]
            shown = [(t, s) for t, s, _ in run.timeline if t >= -window]
            label = f"{system}: " + (
                f"{run.recovered_s:.1f} s, {run.steps_lost} steps lost"
                if run.recovered_s is not None
                else f"no recovery within {timeout:.0f} s"
            )
            ax.plot(
                [t for t, _ in shown],
                [s for _, s in shown],
                ".",
                markersize=3,
                color=colors.get(system),
                label=label,
            )
            low = min([s for _, s in shown] + ([low] if low is not None else []))
            if run.recovered_s is not None:
                ax.axvline(run.recovered_s, color=colors.get(system), linestyle=":", linewidth=1)
                right = max(right, run.recovered_s + 2)
        ax.axvline(0, color="black", linewidth=1)
        ax.set_xlim(-window, right)
        if low is not None:
            ax.set_ylim(bottom=low - 2)
        ax.set_title(
            f"{scenario}, {mode} size ({'--nnodes N' if mode == 'fixed' else '--nnodes 1:N'})",
            fontsize=10,
        )
        ax.set_xlabel("seconds since the fault")
        ax.set_ylabel("step completed (rank 0)")
        ax.legend(fontsize=8, loc="lower right")
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.suptitle(
        "Recovery: steps completed around the fault (solid line); dotted: first step after it"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def replot(json_path: Path, chart_path: Path, timeout: float) -> None:
    """Redraw the chart from a ``--json`` file (no new measurement)."""
    outcomes = [
        Outcome(**{**o, "timeline": [tuple(x) for x in o["timeline"]]})
        for o in json.loads(json_path.read_text())
    ]
    systems = list(dict.fromkeys(o.system for o in outcomes))
    report(outcomes, systems, timeout, chart_path=chart_path)


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=tuple(SCENARIOS),
        default=[s for s in SCENARIOS if s not in NEEDS_ROOT or os.geteuid() == 0],
    )
    parser.add_argument(
        "--modes", nargs="+", choices=("fixed", "elastic"), default=["fixed", "elastic"]
    )
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--workload",
        choices=tuple(WORKLOADS),
        default="cnn",
        help="what the etcd-v3 systems train (sharded: FSDP2 sharded_lm, its own loop; "
        "sharded-trainer: the same through the Trainer; sharded-hsdp: over a 2-replica HSDP "
        "mesh; not with c10d)",
    )
    defaults = BenchConfig()
    for name in (
        "nodes",
        "nproc_per_node",
        "fault_step",
        "checkpoint_every",
        "throttle_ms",
        "recovery_timeout",
        "steps_after",
    ):
        value = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    parser.add_argument(
        "--chart", type=Path, default=HERE / "recovery_timeline.png", help="timeline PNG"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every outcome as JSON")
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep the runs' logs and records in this directory"
    )
    parser.add_argument(
        "--etcd-load",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="instead of faults: count what etcd receives per node and minute over this many "
        "seconds of healthy training (the etcd-v3 systems among --systems)",
    )
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="only redraw the chart and table from an earlier --json file",
    )
    return parser.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = BenchConfig(
            nodes=args.nodes,
            nproc_per_node=args.nproc_per_node,
            fault_step=args.fault_step,
            checkpoint_every=args.checkpoint_every,
            throttle_ms=args.throttle_ms,
            recovery_timeout=args.recovery_timeout,
            steps_after=args.steps_after,
            workload=args.workload,
        )
        if cfg.workload != "cnn" and (baselines := [s for s in args.systems if "c10d" in s]):
            raise ValueError(
                f"--workload {cfg.workload}: the {baselines[0]} baseline trains the CNN only; "
                "compare with --systems etcd-v3 etcd-v3-restart"
            )
        if args.repeats <= 0:
            raise ValueError(f"repeats: must be positive, got {args.repeats}")
    except ValueError as exc:
        print(f"recovery.py: error: {exc}", file=sys.stderr)
        return 2
    if os.geteuid() != 0 and (needs := [s for s in args.scenarios if s in NEEDS_ROOT]):
        print(
            f"recovery.py: error: scenario {needs[0]} needs `ip netns`, which needs root",
            file=sys.stderr,
        )
        return 2
    if args.replot is not None:
        replot(args.replot, args.chart, cfg.recovery_timeout)
        return 0
    from rendezvous.etcd_server import EtcdServer

    outcomes: list[Outcome] = []
    interrupted = False
    try:
        with contextlib.ExitStack() as stack:
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                tmp = str(args.keep)
            else:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="recovery-bench-"))
            etcd = stack.enter_context(
                EtcdServer.single(Path(tmp) / f"etcd-{uuid.uuid4().hex[:6]}")
            )
            if args.etcd_load > 0:
                loads = []
                for system in [s for s in args.systems if s.startswith("etcd-v3")]:
                    workdir = Path(tmp) / f"etcd-load-{system}"
                    workdir.mkdir(exist_ok=args.keep is not None)
                    loads.append(
                        measure_etcd_load(
                            system,
                            cfg,
                            workdir,
                            etcd.member.client_url,
                            etcd.endpoint,
                            args.etcd_load,
                        )
                    )
                    print(
                        f"{system}: {loads[-1]['per_node_per_minute']} etcd messages per node per minute",
                        flush=True,
                    )
                print(
                    f"\n{cfg.nodes} nodes x {cfg.nproc_per_node} workers, healthy training, "
                    f"{args.etcd_load:g} s window\n\n{etcd_load_table(loads)}"
                )
                if args.json is not None:
                    args.json.write_text(json.dumps(loads, indent=1))
                return 0
            for scenario in args.scenarios:
                for mode in [m for m in args.modes if m in SCENARIOS[scenario]]:
                    for repeat in range(args.repeats):
                        for system in args.systems:
                            workdir = Path(tmp) / f"{scenario}-{mode}-{system}-{repeat}"
                            workdir.mkdir(exist_ok=args.keep is not None)
                            outcome = run_one(scenario, mode, system, cfg, workdir, etcd.endpoint)
                            outcomes.append(outcome)
                            print(
                                f"{scenario:>14} {mode:>7} {system:>13} #{repeat}: recovery "
                                f"{fmt_time(outcome.recovered_s, cfg.recovery_timeout)}, steps lost "
                                f"{outcome.steps_lost} (last {outcome.last_step_before}, resumed "
                                f"{outcome.resumed_from})"
                                f"{'' if outcome.ready_s is None or outcome.recovered_s is None else f', launcher ready after {outcome.ready_s:.2f} s, joined {outcome.recovered_s - outcome.ready_s:.2f} s later'}"
                                f"{' ' + outcome.error if outcome.error else ''}",
                                flush=True,
                            )
    except KeyboardInterrupt:
        interrupted = True
        print(f"\ninterrupted: the table of the {len(outcomes)} run(s) finished", file=sys.stderr)
    print()
    print(
        f"{cfg.workload}: {cfg.nodes} nodes x {cfg.nproc_per_node} workers, gloo, fault at step {cfg.fault_step}, checkpoint "
        f"every {cfg.checkpoint_every} steps, {cfg.throttle_ms:g} ms sleep per step; median of {args.repeats}"
    )
    report(outcomes, args.systems, cfg.recovery_timeout, chart_path=args.chart, json_path=args.json)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
