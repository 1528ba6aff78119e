"""``python -m benchmarks.gpu_check [--dry-run] [--only STEP,...] OUT``: run the plan, print and
write the table; exit 1 when a row fails, 2 on bad input or a node that cannot run the check.

Called by ``scripts/gpu-check.sh``, which first installs the carried wheels on a GPU node.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.gpu_check import node, report, runner
from benchmarks.gpu_check.plan import PLAN, Plan

COMMAND = "bash scripts/gpu-check.sh OUT"


def parse_args(argv: Sequence[str] | None, plan: Plan) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument(
        "out", type=Path, help="folder for table.md, results.json and each step's log"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="on CPU with tiny sizes: checks that every step runs and the table is complete",
    )
    parser.add_argument(
        "--only",
        default="",
        metavar="STEP,...",
        help=f"run only these steps (rerun one that failed): {', '.join(plan.by_name)}",
    )
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
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(runner.ROOT), env.get("PYTHONPATH", "")) if p
    )
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU path, even on a GPU node
        gpus, where = (
            0,
            "dry run on CPU, tiny sizes: it checks the wiring; its figures are no measurement",
        )
        info: dict[str, object] = {}
    else:
        try:
            missing = node.missing_on_node()
            if missing:
                raise node.NodeError(f"{sys.executable} lacks {', '.join(missing)}: run `bash scripts/gpu-wheels.sh` "
                                "where pip reaches a registry and bring .whl/ along (scripts/gpu-check.sh "
                                "installs it)")  # fmt: skip
            info = node.probe_gpus(env)
        except node.NodeError as exc:
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
    results = runner.run_plan(
        plan, out=out, dry_run=args.dry_run, gpus=gpus, only=args.only, env=env
    )
    rows, notes = report.rows_of(plan.claims, results)
    command = COMMAND.replace("gpu-check.sh", "gpu-check.sh --dry-run") if args.dry_run else COMMAND
    heading = f"GPU check, {started}, tree {node.git_tree()}: {where}. Command: `{command}`"
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
