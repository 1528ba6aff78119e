"""A seeded random schedule of many faults in one elastic job (``--nnodes 1:3``).

The default suite runs a short schedule (3 faults); the long one is opt-in (README.md here)::

    pytest tests/chaos -m chaos_long --chaos-seed 7 --chaos-faults 20
    CHAOS_LONG=1 CHAOS_SEED=7 CHAOS_FAULTS=20 pytest tests/chaos -k long

Each fault fires once the job has trained ``gap`` more steps since the previous one fired (so it
has recovered from a restart before the next fault hits; a node still joining may not be in yet). Faults: a worker
SIGKILL, a node SIGKILL, a node SIGTERM (scale-down), a node joining, etcd restarted for 5 s,
the newest checkpoint corrupted before every worker is SIGKILLed. Between one and three nodes stay in
the job. The same invariants as every scenario hold at the end. A failing seed reproduces the
same schedule (the timing of the faults relative to steps varies a little from run to run).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.chaos.faults import (
    DamageWindow,
    FaultInjector,
    JobSpec,
    RunDirs,
    damage_newest_checkpoint,
    freeze_workers,
    in_background,
    kill,
    start_node,
    unique_run_id,
    wait_all,
)
from tests.chaos.invariants import check_run, describe
from tests.support.agents import Agent, agents, tails

KINDS = (
    "worker_sigkill",
    "node_sigkill",
    "node_sigterm",
    "node_join",
    "etcd_restart",
    "corrupt_newest",
)
MIN_NODES, MAX_NODES = 1, 3
CLOSED_RUN = "is closed (the job finished or a node gave up before this node could rejoin)"  # launcher's line
WORKERS_TIMEOUT_S = (
    120.0  # a restart round (rendezvous, worker start, checkpoint load) takes seconds
)


@dataclass(frozen=True, slots=True)
class PlannedFault:
    kind: str
    gap: int
    """Steps trained since the previous fault before this one fires."""


def plan(seed: int, count: int) -> list[PlannedFault]:
    """The schedule for ``seed``: ``count`` faults whose node count stays within 1..3."""
    rng = random.Random(seed)
    live, faults = 2, list[PlannedFault]()
    while len(faults) < count:
        kind = rng.choice(KINDS)
        if kind in ("node_sigkill", "node_sigterm") and live <= MIN_NODES:
            continue
        if kind == "node_join" and live >= MAX_NODES:
            continue
        live += {"node_sigkill": -1, "node_sigterm": -1, "node_join": 1}.get(kind, 0)
        faults.append(PlannedFault(kind, rng.randint(6, 12)))
    return faults


def job_for(faults: list[PlannedFault]) -> JobSpec:
    """A job long enough for the schedule (restarts roll back up to a checkpoint interval)."""
    base = JobSpec()
    needed = 30 + sum(f.gap + base.checkpoint_every for f in faults)
    return JobSpec(epochs=max(base.epochs, -(-needed // base.steps_per_epoch)), throttle_ms=50)


@dataclass
class Cluster:
    """The live nodes of the job and what the faults did to it."""

    run: RunDirs
    job: JobSpec
    endpoint: str
    run_id: str
    started: list[Agent]
    live: list[Agent] = field(default_factory=list)
    names: int = 0
    damaged: set[int] = field(default_factory=set)
    damage_windows: list[DamageWindow] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def add_node(self) -> None:
        node = start_node(
            name=f"n{self.names}",
            run=self.run,
            job=self.job,
            endpoint=self.endpoint,
            run_id=self.run_id,
            nnodes=f"{MIN_NODES}:{MAX_NODES}",
            max_restarts=100,
        )
        self.names += 1
        self.started.append(node)
        self.live.append(node)

    def any_node(self, rng: random.Random) -> Agent | None:
        """A running node, preferably one with workers (a node leaving between worker generations
        is a fault too); ``None`` once every node has exited (the job finished)."""
        running = [n for n in self.live if n.proc.poll() is None]
        return rng.choice([n for n in running if n.worker_pids()] or running) if running else None

    def kill_a_worker(self, rng: random.Random, timeout: float = WORKERS_TIMEOUT_S) -> None:
        """SIGKILL a worker of a live node; while every node is between worker generations (a
        fault can land in a restart round), wait for one, up to ``timeout`` seconds. Nothing to
        kill once the job has finished."""
        deadline = time.monotonic() + timeout
        while not self.done():
            candidates = [n for n in self.live if n.worker_pids()]
            if candidates:
                with contextlib.suppress(ProcessLookupError, AssertionError):  # it exited meanwhile
                    rng.choice(candidates).kill_worker(rng.randint(0, 1))
                    return
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"no live node had a worker to kill for {timeout:.0f} s\n{tails(self.started)}"
                )
            time.sleep(0.1)

    def done(self) -> bool:
        return all(node.proc.poll() is not None for node in self.live)


def run_schedule(seed: int, count: int, etcd, no_fault, tmp_path: Path) -> None:
    faults = plan(seed, count)
    job = job_for(faults)
    print(f"seed {seed}: {[f'{f.kind}+{f.gap}' for f in faults]} over {job.steps} steps")
    rng = random.Random(seed + 1)  # picks the victims
    run = RunDirs.under(tmp_path / "run")
    with agents() as started:
        cluster = Cluster(
            run=run,
            job=job,
            endpoint=etcd.endpoint,
            run_id=unique_run_id(f"random-{seed}"),
            started=started,
        )
        cluster.add_node()
        cluster.add_node()

        def worker_sigkill() -> None:
            cluster.kill_a_worker(rng)

        def node_leaves(graceful: bool) -> None:
            node = cluster.any_node(rng)
            if node is None:
                return
            cluster.live.remove(node)
            node.terminate() if graceful else node.kill_node()

        def corrupt_newest() -> None:  # then every worker dies: no survivor saves a newer step
            frozen = freeze_workers(cluster.live)
            try:
                damage = damage_newest_checkpoint(run.checkpoints)
                cluster.damaged.add(damage.step)
                cluster.damage_windows.append(damage)
            finally:
                kill(frozen)

        actions = {
            "worker_sigkill": worker_sigkill,
            "node_sigkill": lambda: node_leaves(graceful=False),
            "node_sigterm": lambda: node_leaves(graceful=True),
            "node_join": cluster.add_node,
            "etcd_restart": in_background(lambda: etcd.restart(down_for=5.0), cluster.threads),
            "corrupt_newest": corrupt_newest,
        }
        injector = FaultInjector(run)
        for fault in faults:
            injector.when(
                _trained_since_previous(injector, fault.gap), fault.kind, actions[fault.kind]
            )
        injector.run_until(cluster.done, timeout=240 + 30 * count, agents=started)
        for thread in cluster.threads:
            thread.join(30)
        codes = wait_all(cluster.live, timeout=60)
        # A node still restarting when the others finished (slowed by a fault) finds the run closed
        # and exits 1 with one line saying so: torch's semantics, and the job is done. Any other
        # non-zero exit, or nobody finishing, is a failure.
        late = {
            n.log_path.name
            for n in cluster.live
            if codes[n.log_path.name] == 1 and CLOSED_RUN in n.output()
        }
        finished = [
            n.log_path.name
            for n in started
            if n.proc.poll() == 0 and "training finished" in n.output()
        ]
        assert finished and all(code == 0 or name in late for name, code in codes.items()), (
            f"exit codes of the nodes left {codes}, finished: {finished}\n{tails(started)}"
        )
        print("fired at steps:", [(f.name, f.fired_at_step) for f in injector.faults])

    summary = check_run(
        run,
        job,
        no_fault,
        reference_world=2,
        damaged=cluster.damaged,
        damage_windows=cluster.damage_windows,
    )
    print(describe(summary))


def _trained_since_previous(injector: FaultInjector, gap: int) -> Callable[[int], bool]:
    """Trigger: ``gap`` steps trained since the previous fault fired (the first: since the start)."""
    index = len(injector.faults)

    def trigger(step: int) -> bool:
        previous = injector.faults[index - 1].fired_at_trained if index else 0
        return previous is not None and injector.run.steps_trained() >= previous + gap

    return trigger


@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_random_schedule_short(own_etcd_server, no_fault, tmp_path: Path, chaos_seed: int) -> None:
    run_schedule(chaos_seed, 3, own_etcd_server, no_fault, tmp_path)


@pytest.mark.chaos
@pytest.mark.chaos_long
@pytest.mark.timeout(3600)
def test_random_schedule_long(
    own_etcd_server, no_fault, tmp_path: Path, chaos_seed: int, chaos_faults: int
) -> None:
    run_schedule(chaos_seed, chaos_faults, own_etcd_server, no_fault, tmp_path)
