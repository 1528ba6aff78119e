"""Fault tolerance as users run it: the same script under the real launchers, side by side.

    python -m benchmarks.launcher_e2e --pairs 3                          # every workload, 4 variants
    python -m benchmarks.launcher_e2e --workloads mlp1024 --pairs 3 --variants bare/torchrun trainer/elastic
    python -m benchmarks.launcher_e2e --device cuda --workloads gpt --pairs 3 --variants bare/torchrun trainer/elastic

Variants (``API/LAUNCHER``): ``bare/torchrun`` is a plain DDP loop under ``torchrun --standalone``
(the baseline); ``trainer/elastic`` is the same job through ``Trainer`` under ``elastic-trainer
run`` at every default (embedded etcd, in-place healing, metrics, warm start, watchdog,
checkpoints every 100 steps); the cross terms ``bare/elastic`` and ``trainer/torchrun`` split the
cost between the launcher and the runtime; ``trainer/elastic+owncontrol`` (opt-in)
the step's control on its own collective (``ELASTIC_TRAINER_CONTROL_CARRIER=0``), as before it rode
on a gradient. The user script is ``benchmarks/launcher_job.py``, two gloo workers on this machine
(any GPU hidden, so that both sides run on the CPU). Each pair runs every variant once, in an
order that alternates between pairs, so that the machine's drift hits all alike; ratios are taken
against the baseline of the same pair and the median over pairs is reported (a claim needs at
least :data:`MIN_PAIRS` pairs).

``--device cuda``: NCCL, one worker per GPU (``--nproc`` defaults to every visible GPU), and the
decoder is GPT-2 small (:data:`CUDA_SIZES`) under bf16 autocast, as the in-process GPU benchmarks
run it. The GPU claim is throughput (the ratio column; samples and tokens per second follow the
table); CPU per step stays recorded. ``--tiny``: every workload at a toy size for a few steps, a
wiring check (the GPU check's dry run, ``benchmarks/gpu_check``) whose figures are no measurement.

Reported per variant: steady-state steps/s of rank 0 (steps ``warmup..steps``), CPU per step
(both workers' processes, every thread, over the same window: the robust figure on a shared
machine), time from the launch to the end of the first step (rank 0) and to the start of the user's script
(its first line), worker threads in steady state, the Python comm hooks on the DDP model (0
expected everywhere) and how the ``Trainer``'s step control travelled (``gradient`` at the defaults
on the CPU). The JSON records also hold ``tree_cpu_s``, the CPU of the reaped process tree
per run: the whole job under torchrun, but not the warm-forked workers of ``elastic-trainer run``
(they are not the launcher's children), so it is not compared. What is compared instead: rank 0
snapshots every process of the job (those whose environment holds this run's
``LAUNCHER_E2E_TAG``) at the window's two ends, so each record holds the CPU per step of the
workers, the launcher, its etcd and the warm server (``cpu_ms_per_step_by_role``,
``side_cpu_ms_per_step``), the busiest and the most waking threads outside the workers, each
worker thread's CPU, and every step's time of rank 0 (``step_ms``: where the periodic
checkpoints fall).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "launcher_job.py"

WORKLOADS: dict[str, list[str]] = {
    "cnn": [
        "--model",
        "cnn",
        "--width",
        "16",
        "--global-batch-size",
        "64",
        "--steps",
        "400",
        "--warmup",
        "100",
    ],
    "mlp1024": [
        "--model",
        "mlp",
        "--width",
        "1024",
        "--global-batch-size",
        "64",
        "--steps",
        "300",
        "--warmup",
        "50",
    ],
    "mlp2048": [
        "--model",
        "mlp",
        "--width",
        "2048",
        "--global-batch-size",
        "64",
        "--steps",
        "200",
        "--warmup",
        "40",
    ],
    "gpt": [
        "--model",
        "gpt",
        "--seq-len",
        "64",
        "--layers",
        "4",
        "--d-model",
        "384",
        "--vocab",
        "8192",
        "--global-batch-size",
        "4",
        "--steps",
        "60",
        "--warmup",
        "15",
    ],
}
"""The example CNN; the 4-layer MLP with one gradient bucket (width 1024, 12.6 MB) and with two (width
2048, 42 MB); a 4-block decoder (d_model 384, 10.3 M parameters) with several buckets."""
CUDA_SIZES: dict[str, list[str]] = {
    "gpt": ["--seq-len", "1024", "--layers", "12", "--d-model", "768", "--vocab", "50304",
            "--steps", "90", "--warmup", "15"],
}  # fmt: skip
"""On CUDA: the decoder is GPT-2 small (124 M parameters, 13 buckets; ``benchmarks/workloads.py``), 8
sequences per GPU, as ``overhead_e2e --device cuda --model gpt`` runs it. A short run, so that 3
pairs fit the GPU check's limit: a 33-35 ms step on an H100 (RESULTS, session 5) makes the steady
window of 75 steps about 2.6 s, and like the CPU decoder's 60 steps it ends before the first
periodic checkpoint (step 100). The CNN and the MLPs keep their shapes."""
CUDA_SAMPLES_PER_GPU = {"gpt": 8}
TINY_SIZES = ["--width", "8", "--seq-len", "16", "--layers", "1", "--d-model", "32", "--vocab", "256",
              "--dataset-size", "64", "--steps", "8", "--warmup", "3"]  # fmt: skip
"""``--tiny``: every workload at a toy size, 5 steady steps, 2 samples per worker: a wiring check."""
TINY_NOTE = "tiny sizes: a wiring check, no measurement"
VARIANTS = (
    "bare/torchrun",
    "trainer/elastic",
    "bare/elastic",
    "trainer/torchrun",
    "elastic/elastic",
    "trainer/elastic+owncontrol",
    "trainer/elastic+carrier",
    "trainer/elastic+nockpt",
    "trainer/elastic+nodebug",
    "elastic/elastic+nodebug",
    "elastic/elastic+nockpt",
)
"""``elastic/elastic``: your own loop on ``Elastic`` (the README's snippet) under ``elastic-trainer
run`` (named to run it; issue 40 measures it against the baseline). ``+owncontrol``: the step's
control on its own gloo collective instead of the model's gradient (the default before the
gradient-carried control, ``runtime/grad_carrier.py``; not run unless named). ``+carrier``: the
control carried by a gradient, named (``ELASTIC_TRAINER_CONTROL_CARRIER=1``): the default since the
heal from one rank to two works with it (issue 30), kept for runs that compare both explicitly.
``+nockpt``: the defaults but no periodic checkpoint inside the run (every 10**6 steps; the final
one stays after the window): splits off what the default checkpoint every 100 steps costs, which
bare DDP does not do (rank 0 copies the state and a thread of it writes the file). ``+nodebug``:
no diagnostics endpoints (``ELASTIC_TRAINER_DEBUG_HOST=off``): against the same variant without
it, what the idle endpoints cost at the defaults (issue 42: at most 0.3 %)."""
VARIANT_ENV = {"nodebug": {"ELASTIC_TRAINER_DEBUG_HOST": "off"}}
"""The environment a variant's suffix adds to the launch."""
DEFAULT_VARIANTS = VARIANTS[:4]
MIN_PAIRS = 3
"""A claim is the median over at least this many alternating pairs (issue 30)."""
BASELINE = "bare/torchrun"
ENV_TREE_TAG = "LAUNCHER_E2E_TAG"
"""A token unique to one run, in the environment of every process of the job: rank 0 of
``launcher_job.py`` snapshots the processes that hold it (the launcher, its etcd and warm server,
the workers) at the steady window's two ends."""


class RunFailed(RuntimeError):
    """A launch that did not exit 0."""


_GPT_ONLY = ("--seq-len", "--layers", "--d-model", "--vocab")


def workload_args(workload: str, *, device: str, nproc: int, tiny: bool) -> list[str]:
    """The user script's options for ``workload``: :data:`WORKLOADS`, with :data:`CUDA_SIZES` on
    CUDA or :data:`TINY_SIZES` for ``--tiny`` in place of the sizes they name."""
    options = _pairs(WORKLOADS[workload])
    if device == "cuda" and workload in CUDA_SIZES:
        options |= _pairs(CUDA_SIZES[workload])
        options["--global-batch-size"] = str(CUDA_SAMPLES_PER_GPU[workload] * nproc)
    if tiny:
        options |= _pairs(TINY_SIZES)
        options["--global-batch-size"] = str(2 * nproc)
    # Each model takes only its own sizes (--tiny names all of them).
    unused = ("--width",) if options["--model"] == "gpt" else _GPT_ONLY
    options = {k: v for k, v in options.items() if k not in unused}
    cuda = ["--device", "cuda"] if device == "cuda" else []  # the CPU line as it always was
    return [*itertools.chain.from_iterable(options.items()), *cuda]


def _pairs(options: list[str]) -> dict[str, str]:
    return dict(zip(options[::2], options[1::2], strict=True))


def _launcher(script: str, module: str) -> list[str]:
    """A launcher's console script beside this Python (what a user types), else ``python -m``
    (a GPU node that runs the tree from ``PYTHONPATH`` has no ``elastic-trainer`` script)."""
    path = Path(sys.executable).parent / script
    return [str(path)] if path.exists() else [sys.executable, "-m", module]


def command(
    variant: str, workload: str, out: str, nproc: int, *, device: str = "cpu", tiny: bool = False
) -> list[str]:
    """The launch line of one run (what a user types, with this venv's tools)."""
    api, launcher = variant.split("+")[0].split("/")
    if launcher == "torchrun":
        head = [*_launcher("torchrun", "torch.distributed.run"), "--standalone"]
    else:
        head = [*_launcher("elastic-trainer", "elastic_trainer.cli"), "run"]
    extra = {
        "owncontrol": ["--control", "collective"],
        "carrier": ["--control", "gradient"],
        "nockpt": ["--checkpoint-every", str(10**6)],
    }.get(variant.partition("+")[2], [])
    job = workload_args(workload, device=device, nproc=nproc, tiny=tiny)
    return [*head, "--nproc-per-node", str(nproc), str(SCRIPT), "--api", api, *job, *extra,
            "--out", out]  # fmt: skip


def _role(cmd: str, pid: str, workers: set[str]) -> str:
    """What a process of the job is, for the side CPU breakdown."""
    if pid in workers:
        return "workers"
    for needle, role in (
        ("etcd", "etcd"),
        ("warm_start serve", "warm server"),
        ("warm_start --socket", "warm clients"),
        ("elastic-trainer run", "launcher"),
        ("elastic_trainer.cli run", "launcher"),
        ("torchrun", "launcher"),
        ("torch.distributed.run", "launcher"),
    ):
        if needle in cmd:
            return role
    return "other"


def side_cpu(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """CPU ms per steady step of every process of the job, by role, from rank 0's two snapshots of
    the process tree at the window's ends (``launcher_job.tree_snapshot``); the busiest threads
    outside the workers; and the voluntary context switches (wakeups) per step outside them."""
    tree, steps = ranks[0].get("tree", []), ranks[0]["steps"]
    if len(tree) != 2 or not steps:
        return {}
    start, end = tree[0]["processes"], tree[1]["processes"]
    workers = {str(r["pid"]) for r in ranks}
    roles: dict[str, float] = {}
    threads: dict[str, float] = {}
    wakeups: dict[str, int] = {}
    worker_threads: dict[str, float] = {}
    for pid, proc in end.items():
        role = _role(proc["cmd"], pid, workers)
        before = start.get(pid, {}).get("threads", {})
        for tid, (name, cpu_ns, voluntary, _involuntary) in proc["threads"].items():
            old = before.get(tid, [name, 0, 0, 0])
            ms = (cpu_ns - old[1]) / 1e6 / steps
            roles[role] = roles.get(role, 0.0) + ms
            if role == "workers":
                worker_threads[name] = worker_threads.get(name, 0.0) + ms
            else:
                key = f"{role}/{name}"
                threads[key] = threads.get(key, 0.0) + ms
                wakeups[key] = wakeups.get(key, 0) + voluntary - old[2]
    busiest = dict(sorted(threads.items(), key=lambda kv: -kv[1])[:6])
    waking = dict(sorted(wakeups.items(), key=lambda kv: -kv[1])[:6])
    return {
        "cpu_ms_per_step_by_role": {k: round(v, 3) for k, v in sorted(roles.items())},
        "side_cpu_ms_per_step": round(sum(v for k, v in roles.items() if k != "workers"), 3),
        "side_busiest_threads": {k: round(v, 3) for k, v in busiest.items()},
        "worker_threads_cpu_ms_per_step": {
            k: round(v, 3) for k, v in sorted(worker_threads.items(), key=lambda kv: -kv[1])
        },
        "side_wakeups_per_step": round(sum(wakeups.values()) / steps, 2),
        "side_waking_threads": {k: round(v / steps, 2) for k, v in waking.items()},
    }


def run_once(variant: str, workload: str, nproc: int, tmp: Path, timeout: float, *,
             device: str = "cpu", tiny: bool = False) -> dict[str, Any]:  # fmt: skip
    """Launch one job, wait for it; its ranks' records and what the process tree cost."""
    out = tmp / f"{workload}-{variant.replace('/', '-')}-{time.monotonic_ns()}"
    path = os.environ.get("PYTHONPATH")  # a GPU node's carried packages stay on it
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *([path] if path else [])]),
        "OMP_NUM_THREADS": "1",
        ENV_TREE_TAG: uuid.uuid4().hex,
        **VARIANT_ENV.get(variant.partition("+")[2], {}),
    }
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the Trainer would take a GPU it sees; bare DDP runs gloo
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launched = time.time()
    done = subprocess.run(
        command(variant, workload, str(out), nproc, device=device, tiny=tiny),
        env=env,
        cwd=tmp,
        timeout=timeout,
        capture_output=True,
        text=True,
    )
    ended = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RunFailed(f"{variant} {workload} exited {done.returncode}:\n{done.stderr[-3000:]}")
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(nproc)]
    steps = ranks[0]["steps"]
    step_ms = sorted(ranks[0].get("step_ms", []))
    steps_per_s = steps / ranks[0]["wall_s"]
    samples_per_s = steps_per_s * ranks[0]["samples_per_step"]
    return {
        "variant": variant,
        "workload": workload,
        "device": device,
        "steps_per_s": steps_per_s,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * ranks[0]["tokens_per_sample"],
        "cpu_ms_per_step": 1e3 * sum(r["cpu_s"] for r in ranks) / steps,
        "first_step_s": ranks[0]["first_step_unix"] - launched,
        "script_start_s": ranks[0]["started_unix"] - launched,
        "tree_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "run_s": ended - launched,
        "threads": ranks[0]["threads"],
        "comm_hooks": max(r["comm_hooks"] for r in ranks),
        "control": ranks[0].get("control", "-") if not variant.startswith("bare") else "-",
        "cpu_ms_per_step_by_rank": [round(1e3 * r["cpu_s"] / r["steps"], 2) for r in ranks],
        "step_ms": ranks[0].get("step_ms", []),
        "step_ms_p50_p90_p99_max": [
            step_ms[min(len(step_ms) - 1, int(q * len(step_ms)))] for q in (0.5, 0.9, 0.99, 1.0)
        ]
        if step_ms
        else [],
        **side_cpu(ranks),
    }


def summarize(results: list[dict[str, Any]], variants: tuple[str, ...]) -> str:
    """The headline table: medians, and each variant's median ratio to the baseline of its pair."""
    lines = [
        "| workload | variant | steps/s (median; min-max) | ratio | CPU ms/step | CPU ratio | first step s | "
        "first step - baseline s | script start s | threads | hooks | control |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in workloads_of(results):
        rows = [r for r in results if r["workload"] == workload]
        pairs = sorted({r["pair"] for r in rows})
        base = {r["pair"]: r for r in rows if r["variant"] == BASELINE}
        for variant in variants:
            mine = [r for r in rows if r["variant"] == variant]
            if not mine:
                continue
            rate = [r["steps_per_s"] for r in mine]
            ratio = [
                r["steps_per_s"] / base[r["pair"]]["steps_per_s"] for r in mine if r["pair"] in base
            ]
            cpu_ratio = [
                r["cpu_ms_per_step"] / base[r["pair"]]["cpu_ms_per_step"]
                for r in mine
                if r["pair"] in base
            ]
            first_delta = [
                r["first_step_s"] - base[r["pair"]]["first_step_s"]
                for r in mine
                if r["pair"] in base
            ]
            lines.append(
                f"| {workload} | {variant} | {statistics.median(rate):.2f} ({min(rate):.2f}-{max(rate):.2f}) | "
                f"{statistics.median(ratio):.3f} | {statistics.median(r['cpu_ms_per_step'] for r in mine):.2f} | "
                f"{statistics.median(cpu_ratio):.3f} | {statistics.median(r['first_step_s'] for r in mine):.2f} | "
                f"{statistics.median(first_delta):+.2f} | {statistics.median(r['script_start_s'] for r in mine):.1f} | "
                f"{max(r['threads'] for r in mine)} | {max(r['comm_hooks'] for r in mine)} | "
                f"{'/'.join(sorted({r.get('control', '-') for r in mine}))} |"
            )
        lines.append(f"| {workload} | pairs | {len(pairs)} | | | | | | | | | |")
    lines += ["", throughput(results, variants)]
    if any(len({r["pair"] for r in results if r["workload"] == w}) < MIN_PAIRS
           for w in workloads_of(results)):  # fmt: skip
        lines += [
            "",
            f"fewer than {MIN_PAIRS} pairs: no claim (a claim is the median of >= {MIN_PAIRS})",
        ]
    return "\n".join(lines)


def workloads_of(results: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["workload"] for r in results))


def throughput(results: list[dict[str, Any]], variants: tuple[str, ...]) -> str:
    """Samples and tokens (the decoder's) per second, medians over the pairs: the GPU claim is
    throughput, whose ratio is the headline table's (both sides take the same batch)."""
    lines = ["| workload | variant | samples/s (median) | tokens/s (median) |", "|---|---|---|---|"]
    for workload in workloads_of(results):
        for variant in variants:
            mine = [r for r in results if r["workload"] == workload and r["variant"] == variant]
            if mine:
                samples = statistics.median(r["samples_per_s"] for r in mine)
                tokens = statistics.median(r["tokens_per_s"] for r in mine)
                lines.append(f"| {workload} | {variant} | {samples:.1f} | {tokens:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    parser.add_argument(
        "--pairs",
        type=int,
        default=MIN_PAIRS,
        help=f"rounds of every variant, order alternating (>= {MIN_PAIRS} for a claim)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo workers, the GPUs hidden; cuda: NCCL, one worker per GPU, GPT-2 small",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="workers per run (default: 2 on cpu, every GPU on cuda)",
    )
    parser.add_argument("--tiny", action="store_true", help=f"toy sizes, a few steps: {TINY_NOTE}")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument(
        "--json", default=None, help="append every run's record to this file (JSON lines)"
    )
    args = parser.parse_args(argv)
    if args.pairs < 1 or (args.nproc is not None and args.nproc < 1):
        parser.exit(2, "launcher_e2e: --pairs and --nproc must be at least 1\n")
    if args.device == "cuda":
        from benchmarks.workloads import cuda_processes  # imports torch: only for a GPU run

        try:
            args.nproc = cuda_processes(args.nproc)
        except ValueError as exc:
            parser.exit(2, f"launcher_e2e: {exc}\n")
    nproc = args.nproc or 2
    print(f"launcher_e2e: {nproc} {args.device} worker(s) per run{'; ' + TINY_NOTE if args.tiny else ''}",
          flush=True)  # fmt: skip
    variants = tuple(args.variants) if BASELINE in args.variants else (BASELINE, *args.variants)
    results: list[dict[str, Any]] = []

    def run(variant: str, workload: str, tmp: str) -> dict[str, Any]:
        return run_once(variant, workload, nproc, Path(tmp), args.timeout, device=args.device,
                        tiny=args.tiny)  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads:
            for pair in range(args.pairs):
                for variant in variants if pair % 2 == 0 else variants[::-1]:
                    try:
                        record = run(variant, workload, tmp)
                    except (
                        RunFailed
                    ) as exc:  # a shared machine: another job may hold the metrics port
                        print(f"retrying once: {exc}", file=sys.stderr, flush=True)
                        record = run(variant, workload, tmp)
                    record |= {"pair": pair}
                    results.append(record)
                    print(
                        json.dumps({k: v for k, v in record.items() if k != "step_ms"}), flush=True
                    )
                    if args.json:
                        with open(args.json, "a") as file:
                            file.write(json.dumps(record) + "\n")
    print(summarize(results, variants))


if __name__ == "__main__":
    main()
