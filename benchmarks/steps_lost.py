"""Steps lost to a worker SIGKILL with the default checkpoint interval (100 steps).

A torchrun agent (real ``etcd-v3`` rendezvous on an embedded etcd, 2 workers, gloo) runs the
``synthetic_cnn`` example with the default ``--checkpoint-every``. At random moments a worker is
SIGKILLed; torchrun restarts the group, which resumes from rank 0's newest checkpoint. For every
kill: steps lost = last step recorded before the kill - step resumed from (the work redone), and
recovery time = kill -> first step of the restarted group.

    python benchmarks/steps_lost.py --kills 8 --modes sync async
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_trainer.config import DEFAULT_CHECKPOINT_EVERY  # noqa: E402
from elastic_trainer.sample_log import read_records  # noqa: E402
from rendezvous.etcd_server import EtcdServer  # noqa: E402
from tests.runtime_helpers import start_agent, wait_for  # noqa: E402


def _generations(samples: Path) -> dict[str, dict]:
    """generation id -> {started, resumed, last_step, first_step_seen}."""
    found: dict[str, dict] = {}
    for records in read_records(samples):
        start = records[0]
        g = found.setdefault(start["generation"], {"started": start["started_unix"], "resumed": start["resumed_step"],
                                                   "last": start["resumed_step"], "seen": set()})
        g["seen"].update(r["step"] for r in records[1:] if r["event"] == "step")
        g["last"] = max(g["seen"], default=g["last"])
        g["steps"] = len(g["seen"])
    return found


def measure(mode: str, args: argparse.Namespace, endpoint: str, work: Path) -> list[tuple[int, float]]:
    samples = work / f"{mode}-samples"
    job = ["--max-steps", "1000000", "--epochs", "1000000", "--dataset-size", "4096", "--global-batch-size", "64",
           "--checkpoint-dir", str(work / f"{mode}-ckpt"), "--record-samples", str(samples), "--log-every", "1000"]
    if mode == "async":
        job.append("--async-checkpoint")
    agent = start_agent(endpoint=endpoint, run_id=f"steps-lost-{mode}-{time.time_ns()}", log_path=work / f"{mode}.log",
                        job_args=job, max_restarts=args.kills + 1)
    rng = random.Random(args.seed)
    results = []
    try:
        for kill in range(args.kills):
            before = set(_generations(samples))
            # Let the group run past at least one checkpoint interval, then kill at a random moment.
            wait_for(lambda: any(g["steps"] > 2 * DEFAULT_CHECKPOINT_EVERY for g in _generations(samples).values()
                                 if g["started"] == max(x["started"] for x in _generations(samples).values())),
                     timeout=300, what="training to progress", agents=[agent], interval=0.1)
            time.sleep(rng.uniform(0, args.max_delay_s))
            current = max(_generations(samples).items(), key=lambda kv: kv[1]["started"])[0]
            agent.kill_worker(rng.randint(0, 1))
            killed_at = time.monotonic()
            time.sleep(0.5)  # let the dying group's last record land
            last = _generations(samples)[current]["last"]
            old = before | {current}

            def restarted(old: set[str] = old) -> list[dict]:
                return [g for gid, g in _generations(samples).items() if gid not in old and g["steps"] > 0]

            new = wait_for(restarted, timeout=300, what="the restarted group's first step",
                           agents=[agent], interval=0.05)
            recovery = time.monotonic() - killed_at
            lost = last - new[0]["resumed"]
            results.append((lost, recovery))
            print(f"{mode} kill {kill}: last step {last}, resumed from {new[0]['resumed']}, "
                  f"lost {lost} steps, first new step after {recovery:.1f} s", flush=True)
    finally:
        agent.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--modes", nargs="+", choices=("sync", "async"), default=["sync", "async"])
    parser.add_argument("--max-delay-s", type=float, default=4.0, help="random delay before each kill")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = EtcdServer.single(work / "etcd").start()
        try:
            table = {mode: measure(mode, args, server.endpoint, work) for mode in args.modes}
        finally:
            server.stop()
    print()
    print(f"checkpoint every {DEFAULT_CHECKPOINT_EVERY} steps (default)")
    print("| mode | kills | steps lost: mean | median | max | recovery s (kill -> first new step): median |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, rows in table.items():
        lost = [r[0] for r in rows]
        rec = [r[1] for r in rows]
        print(f"| {mode} | {len(rows)} | {statistics.mean(lost):.1f} | {statistics.median(lost):.0f} | {max(lost)} | "
              f"{statistics.median(rec):.1f} |")


if __name__ == "__main__":
    main()
