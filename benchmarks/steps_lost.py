"""Steps lost to a worker SIGKILL, just-in-time (JIT) save on vs off, side by side.

A torchrun agent (real ``etcd-v3`` rendezvous on an embedded etcd, 2 workers, gloo) runs the
``synthetic_cnn`` example with the default ``--checkpoint-every`` (100). At random moments a
random worker is SIGKILLed; torchrun restarts the group, which resumes from the newest
checkpoint: with JIT on, the one a surviving rank wrote of the last completed step; with JIT off
(``ELASTIC_TRAINER_JIT_SAVE=0``), rank 0's last periodic one. For every kill: steps lost = last
step any rank recorded before the kill - step the restarted group resumed from (the work
redone), and recovery time = kill -> first step of the restarted group. Both modes use the same
seeded kill schedule.

    python -m benchmarks.steps_lost --kills 8 --modes off jit
    python -m benchmarks.steps_lost --kills 8 --modes off jit off-async jit-async

Modes run one after the other. If one fails (or Ctrl-C), the rest are skipped and the table of
the modes already measured is still printed (exit status 1, or 130 after Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from elastic_trainer.checkpoint.config import DEFAULT_CHECKPOINT_EVERY
from elastic_trainer.ops.processes import NodeProcess, start_process, wait_for
from elastic_trainer.runtime.sample_log import generations
from elastic_trainer.runtime.settings import ENV_JIT_SAVE
from rendezvous.etcd_server import EtcdServer

MODES = {
    "off": {"jit": "0", "async": False},
    "jit": {"jit": "1", "async": False},
    "off-async": {"jit": "0", "async": True},
    "jit-async": {"jit": "1", "async": True},
}


# Fast elastic rounds: the 30 s last-call default would dominate every restart.
RDZV_CONF = "last_call_timeout=1,join_timeout=120,retry_timeout=10"


def start_agent(
    endpoint: str, run_id: str, log_path: Path, job_args: Sequence[str], max_restarts: int, jit: str
) -> NodeProcess:
    """``torchrun --rdzv-backend=etcd-v3 ... -m synthetic_cnn JOB_ARGS``: one node, two workers."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", ENV_JIT_SAVE: jit}
    env.pop("ELASTIC_TRAINER_METRICS", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={RDZV_CONF}",
        "--nnodes=1",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        "-m",
        "elastic_trainer.examples.synthetic_cnn",
        *job_args,
    ]
    return start_process(cmd, log_path, env)


def measure(
    mode: str, args: argparse.Namespace, endpoint: str, work: Path
) -> list[tuple[int, float]]:
    """Kill a worker ``args.kills`` times; ``(steps lost, recovery seconds)`` per kill."""
    samples = work / f"{mode}-samples"
    job = [
        "--max-steps",
        "1000000",
        "--epochs",
        "1000000",
        "--dataset-size",
        "4096",
        "--global-batch-size",
        "64",
        "--checkpoint-dir",
        str(work / f"{mode}-ckpt"),
        "--record-samples",
        str(samples),
        "--log-every",
        "1000",
    ]
    if MODES[mode]["async"]:
        job.append("--async-checkpoint")
    agent = start_agent(
        endpoint,
        f"steps-lost-{mode}-{time.time_ns()}",
        work / f"{mode}.log",
        job,
        max_restarts=args.kills + 1,
        jit=str(MODES[mode]["jit"]),
    )
    rng = random.Random(args.seed)  # the same kill schedule for every mode
    results = []
    try:
        for kill in range(args.kills):
            # Let the group run past two checkpoint intervals, then kill at a random moment.
            wait_for(
                lambda: (
                    (gens := generations(samples))
                    and gens[-1].last_step - gens[-1].resumed_step > 2 * DEFAULT_CHECKPOINT_EVERY
                ),
                timeout=300,
                what="training to progress",
                describe=agent.tail,
                interval=0.1,
            )
            time.sleep(rng.uniform(0, args.max_delay_s))
            current = generations(samples)[-1]
            index = rng.randint(0, 1)
            agent.kill_worker(index)
            killed_at = time.monotonic()

            def restarted(old: str = current.id) -> bool:
                gens = generations(samples)
                return gens[-1].id != old and gens[-1].last_step > gens[-1].resumed_step

            wait_for(
                restarted, timeout=300, what="the restarted group's first step", describe=agent.tail
            )
            recovery = time.monotonic() - killed_at
            # The old group's workers are all gone before the new one starts: its records are final.
            old, new = (
                next(g for g in generations(samples) if g.id == current.id),
                generations(samples)[-1],
            )
            lost = old.last_step - new.resumed_step
            results.append((lost, recovery))
            print(
                f"{mode} kill {kill}: worker #{index}, last step {old.last_step}, resumed from {new.resumed_step}, "
                f"lost {lost} steps, first new step after {recovery:.1f} s",
                flush=True,
            )
    finally:
        agent.stop()
    return results


Samples = list[tuple[int, float]]
"""(steps lost, recovery seconds) of each kill."""


def measure_modes(
    modes: Sequence[str], measure_one: Callable[[str], Samples]
) -> tuple[dict[str, Samples], str | None]:
    """Measure the modes in order, stopping at the first that fails. Returns the samples of the
    modes measured and, when one failed or Ctrl-C stopped the run, one line saying so."""
    table: dict[str, Samples] = {}
    for mode in modes:
        try:
            table[mode] = measure_one(mode)
        except KeyboardInterrupt:
            return table, f"interrupted during mode {mode}"
        except Exception as exc:  # reported with the table of the modes before it, never hidden
            return table, f"mode {mode} failed: {type(exc).__name__}: {exc}"
    return table, None


def summarise(table: dict[str, Samples]) -> str:
    """The Markdown table and the JIT-vs-periodic comparison lines."""
    lines = [
        f"checkpoint every {DEFAULT_CHECKPOINT_EVERY} steps (default); JIT = just-in-time save of the last "
        "completed step",
        "| mode | kills | steps lost: mean | median | max | recovery s (kill -> first new step): median | max |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, rows in table.items():
        lost = [r[0] for r in rows]
        rec = [r[1] for r in rows]
        lines.append(
            f"| {mode} | {len(rows)} | {statistics.mean(lost):.1f} | {statistics.median(lost):.0f} | "
            f"{max(lost)} | {statistics.median(rec):.1f} | {max(rec):.1f} |"
        )
    for off, on in (("off", "jit"), ("off-async", "jit-async")):
        if off in table and on in table:
            lost_off = statistics.mean(r[0] for r in table[off])
            lost_on = statistics.mean(r[0] for r in table[on])
            rec_off = statistics.median(r[1] for r in table[off])
            rec_ratio = (
                f"{statistics.median(r[1] for r in table[on]) / rec_off:.2f}"
                if rec_off > 0
                else "-"
            )
            ratio = f"{lost_off / lost_on:.0f}x fewer" if lost_on > 0 else "all of them avoided"
            lines.append(
                f"{on} vs {off}: mean steps lost {lost_off:.1f} -> {lost_on:.1f} ({ratio}); "
                f"median recovery time ratio {rec_ratio}"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=["off", "jit"])
    parser.add_argument(
        "--max-delay-s", type=float, default=4.0, help="random delay before each kill"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep logs, sample records and checkpoints here (default: a temporary directory)",
    )
    args = parser.parse_args()
    if args.kills < 1:
        parser.error(f"--kills: must be at least 1, got {args.kills}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) if args.work_dir is None else args.work_dir
        work.mkdir(parents=True, exist_ok=True)
        server = EtcdServer.single(work / "etcd").start()
        try:
            table, problem = measure_modes(
                args.modes, lambda mode: measure(mode, args, server.endpoint, work)
            )
        finally:
            server.stop()
    print()
    if problem:
        print(f"steps_lost.py: {problem}; the table has the modes measured before", file=sys.stderr)
    print(summarise(table))
    if problem is None:
        return 0
    return 130 if problem.startswith("interrupted") else 1


if __name__ == "__main__":
    sys.exit(main())
