"""Training throughput with metrics on vs off, side by side (goal: on/off >= 0.99).

The default workload is the runtime's example model (``elastic_trainer.examples.synthetic_cnn``,
width 32, global batch 128) on 2 gloo workers, OMP_NUM_THREADS=1. ``--device cuda`` runs one NCCL
worker per GPU instead, and ``--model gpt`` a GPT-2-small-shaped decoder (``workloads.py``) in
bf16 autocast: the real-model measurement; there every step ends in ``loss.item()`` (the
runtime synchronises every step too), so a step's wall time is its GPU time plus whatever the
host adds, and the wall ratio is the throughput ratio. "On" is everything a job started by
``elastic-trainer run`` pays for: ``start_launcher_metrics`` in the parent (multiprocess
directory, node endpoint scraped every ``--scrape-interval`` s, torch elastic handlers),
``worker_observer()`` in each worker and its allreduce timing on DDP (``sampled``, the default:
DDP's own C++ statistics, no comm hook; ``--trace``: the flight recorder). "Off" is a plain DDP
step with no observer.

Main measurement, interleaved per step: each worker holds the model three times (same weights)
and trains one step of each arm -- off, aa (a second, identical off: the A/A noise floor) and
on -- per cycle, on the same batch, in an order rotated every cycle; every ``--rebuild-every``
cycles all three models are built anew in a rotated order (where a model's tensors land in
memory biases its steps by up to ~1 % for its whole life, which a fixed A/A pair showed run to
run), and the first few cycles after a rebuild are left out. Each step's CPU seconds
(all threads of the process: gloo's included) and wall seconds are
recorded; the extra cost ``d`` of an arm is taken per cycle against the off step next to it, so
drift of a shared machine cancels at the scale of one step. Ratio = off / (off + d), reported
with the median d (robust to other tenants) and the mean d (which also counts the rare costs:
flushes every second, scrapes every 15 s), per run and over ``--repeat`` runs. The endpoint's
CPU per scrape is measured in the parent and spread over the steps between two scrapes.

Optional: ``--end-to-end`` times whole torchrun jobs of the example (median of rank 0's
``samples/s`` windows, off/on interleaved across runs: much noisier on a shared machine); and
the single-process CPU cost of DDP's sampled timing per step and of ``on_step`` (best of 9).

Usage::

    python -m benchmarks.metrics_overhead                     # 3 x 1500 cycles, + micro
    python -m benchmarks.metrics_overhead --no-allreduce      # attribute: all but the allreduce timing
    python -m benchmarks.metrics_overhead --end-to-end --rounds 3 --max-steps 800
    python -m benchmarks.metrics_overhead --device cuda --model gpt --cycles 300 --rebuild-every 100
    python -m benchmarks.metrics_overhead --device cuda --model gpt --cycles 300 --rebuild-every 100 --trace
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.workloads import add_workload_arguments, resolve_workload_arguments
from rendezvous.etcd_server import free_port

ROOT = Path(__file__).resolve().parents[1]

LAUNCHER = """
import sys, threading, urllib.request
import torch.distributed.run as torchrun
mode, interval, args = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
if mode == "off":
    torchrun.main(args)
else:
    from elastic_trainer.launch.node_metrics import LauncherMetricsConfig, start_launcher_metrics
    with start_launcher_metrics(LauncherMetricsConfig(addr="127.0.0.1", port=0)) as handle:
        stop, scrapes = threading.Event(), [0]
        def scrape():
            while not stop.wait(interval):
                with urllib.request.urlopen(handle.url, timeout=10) as r:
                    r.read()
                scrapes[0] += 1
        thread = threading.Thread(target=scrape, daemon=True)
        thread.start()
        try:
            torchrun.main(args)
        finally:
            stop.set()
            thread.join()
        print(f"SCRAPES {scrapes[0]}", flush=True)
"""

MICRO = """
import sys, time, torch, torch.distributed as dist
from elastic_trainer.metrics.worker import worker_observer
steps, reps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
# A tiny model (one bucket, ~20 us of math) so that the timing's fixed cost is a visible share.
obs = worker_observer()
models = {}
for kind in ("off", "sampled"):
    torch.manual_seed(0)
    models[kind] = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
obs.wrap_ddp(models["sampled"])  # DDP times one backward in ten (torch's default: one in 100)
obs.on_start(world_size=2, restart_count=0)
x = torch.randn(4, 16)
best = {k: float("inf") for k in models}
for _ in range(reps):  # best of N: other tenants only ever add time
    for kind, model in models.items():
        t = time.process_time()
        for _ in range(steps):
            model(x).sum().backward()
        best[kind] = min(best[kind], (time.process_time() - t) / steps)
obs_best = float("inf")
for _ in range(reps):
    t = time.process_time()
    for step in range(steps):
        obs.on_step(step=step, duration_s=0.03, data_wait_s=0.001, samples=64, tokens=0, loss=1.0)
    obs_best = min(obs_best, (time.process_time() - t) / steps)
print(best["off"], best["sampled"], obs_best, flush=True)
dist.destroy_process_group()  # gloo can abort at interpreter exit with its threads still up
"""

ARMS = ("off", "aa", "on")
REBUILD_SETTLE = 5  # cycles left out after the models are rebuilt (DDP rebuilds its buckets)


def interleaved_worker(
    rank: int, world: int, port: int, args: argparse.Namespace, results: Any
) -> None:
    """One worker of the interleaved measurement (torch.multiprocessing spawn target).

    Holds the example's model three times (same weights): "off" and "aa" plain DDP with no
    observer, "on" with ``worker_observer()`` and (unless ``--no-allreduce``) its allreduce
    timing. Every cycle trains one step of each on the same batch, in an order rotated every
    cycle (so no arm always follows another), and records each step's CPU seconds (this process,
    all threads: gloo's included) and wall seconds. "aa" is the A/A arm: it differs from
    "off" in nothing, so its spread is the measurement's noise floor.
    """
    os.environ["TORCHELASTIC_RUN_ID"] = "bench"  # the observer's run id label

    import torch
    import torch.distributed as dist

    from benchmarks.workloads import autocast_of, init_worker, rank_batches, train_step, workload_of
    from elastic_trainer.metrics.worker import worker_observer
    from elastic_trainer.runtime.observer import NullObserver, TrainingObserver
    from elastic_trainer.runtime.settings import ENV_METRICS_ALLREDUCE

    os.environ[ENV_METRICS_ALLREDUCE] = (
        "trace" if args.trace else "sampled" if args.time_allreduce else "0"
    )
    if args.trace:  # before the first process group: the recorder reads its size once
        from elastic_trainer.metrics.collective_trace import trace_environment

        trace_environment(os.environ)
    init_worker(rank, world, port, args)
    # With the recorder, "on" must read only its own buckets: every arm gets a group of its own.
    groups = {arm: dist.new_group(list(range(world))) if args.trace else None for arm in ARMS}
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    job = workload_of(args)
    per_rank = args.global_batch_size // world
    batches = rank_batches(job, args, rank, world, device)
    autocast = autocast_of(args)

    def build(generation: int) -> dict[str, tuple[Any, TrainingObserver, Any]]:
        # Fresh models, built in an order rotated every generation: where each arm's tensors land
        # in memory biases its step time by up to ~1 % for the life of the model (the A/A arm
        # shows it), so no arm may keep one placement for a whole run.
        setups.clear()  # free the last generation's models first (GPU memory)
        fresh: dict[str, tuple[Any, TrainingObserver, Any]] = {}
        shift = generation % len(ARMS)
        for arm in ARMS[shift:] + ARMS[:shift]:
            torch.manual_seed(0)
            ddp = torch.nn.parallel.DistributedDataParallel(job.model().to(device), device_ids=[rank] if cuda else None,
                                                            process_group=groups[arm])  # fmt: skip
            observer: TrainingObserver = NullObserver()
            if arm == "on":
                observer = worker_observer()
                observer.wrap_ddp(ddp)  # nothing with --no-allreduce (time_allreduce is off)
            observer.on_start(world_size=world, restart_count=0)
            fresh[arm] = (ddp, observer, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))
        return fresh

    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    wall: dict[str, list[float]] = {arm: [] for arm in ARMS}
    observer_ns: list[int] = []  # time inside each on_step of the "on" arm (flushes included)
    clock, cpu_clock = time.perf_counter, time.process_time
    setups: dict[str, tuple[Any, TrainingObserver, Any]] = {}
    settled_at = args.warmup
    tokens = job.tokens_per_sample * per_rank
    for cycle in range(args.warmup + args.cycles):
        if cycle >= args.warmup and (cycle - args.warmup) % args.rebuild_every == 0:
            setups = build((cycle - args.warmup) // args.rebuild_every)
            settled_at = cycle + REBUILD_SETTLE
        elif not setups:
            setups = build(0)
        x, y = batches[cycle % len(batches)]
        shift = cycle % len(ARMS)
        for arm in ARMS[shift:] + ARMS[:shift]:
            ddp, observer, opt = setups[arm]
            started, cpu_started = clock(), cpu_clock()
            t0 = time.monotonic()
            value = train_step(job, ddp, opt, x, y, autocast)
            in_observer = time.perf_counter_ns()
            observer.on_step(step=cycle + 1, duration_s=time.monotonic() - t0, data_wait_s=0.0,
                             samples=len(y), tokens=tokens, loss=value)  # fmt: skip
            in_observer = time.perf_counter_ns() - in_observer
            cpu_s, wall_s = cpu_clock() - cpu_started, clock() - started
            if cycle >= settled_at:
                cpu[arm].append(cpu_s)
                wall[arm].append(wall_s)
                if arm == "on":
                    observer_ns.append(in_observer)
    results.put((rank, cpu, wall, observer_ns))
    dist.destroy_process_group()


def run_interleaved(args: argparse.Namespace) -> dict[str, Any]:
    """Per-step CPU and wall seconds of every arm (all ranks), the launcher's CPU seconds and
    the scrapes done; see :func:`interleaved_worker`. The launcher side
    (``start_launcher_metrics``: multiprocess directory, node endpoint, torch elastic handlers)
    runs in this process and a thread scrapes ``/metrics`` every ``--scrape-interval`` s."""
    import threading
    import urllib.request

    import torch.multiprocessing as mp

    from elastic_trainer.launch.node_metrics import LauncherMetricsConfig, start_launcher_metrics

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    config = LauncherMetricsConfig(addr="127.0.0.1", port=0, run_id="bench")
    with start_launcher_metrics(config) as handle:
        stop, scrape_s, scrape_cpu = threading.Event(), [], []

        def scrape() -> None:
            while not stop.wait(args.scrape_interval):
                # This process's CPU during a scrape: the endpoint's thread and this client (the
                # main thread only waits for the workers).
                t0, c0 = time.perf_counter(), time.process_time()
                with urllib.request.urlopen(handle.url, timeout=10) as response:
                    response.read()
                scrape_s.append(time.perf_counter() - t0)
                scrape_cpu.append(time.process_time() - c0)

        thread = threading.Thread(target=scrape, daemon=True)
        thread.start()
        launcher_cpu = time.process_time()
        reports: list[Any] = []
        try:
            context = mp.start_processes(interleaved_worker, args=(args.nproc, free_port(), args, results),
                                         nprocs=args.nproc, start_method="spawn", join=False)  # fmt: skip
            # Read the reports before joining: a worker cannot exit before its queued report (far
            # more than a pipe buffer) has been read.
            while len(reports) < args.nproc:
                try:
                    reports.append(results.get(timeout=1.0))
                except queue.Empty:
                    context.join(timeout=0)  # raises if a worker failed
            while not context.join():
                pass
        finally:
            stop.set()
            thread.join()
        launcher_cpu = time.process_time() - launcher_cpu
    reports.sort()
    return {
        # Every rank recorded the same cycles (all leave out the same settling cycles).
        "cpu": {
            arm: [sum(r[1][arm][i] for r in reports) for i in range(len(reports[0][1][arm]))]
            for arm in ARMS
        },
        "wall": {arm: reports[0][2][arm] for arm in ARMS},  # rank 0: ranks wait for each other
        # Per rank and step: median (the usual step) and mean (with the flushes).
        "observer_median_s": statistics.median(ns for r in reports for ns in r[3]) / 1e9,
        "observer_mean_s": statistics.fmean(ns for r in reports for ns in r[3]) / 1e9,
        "launcher_cpu": launcher_cpu,
        "scrapes": len(scrape_s),
        "scrape_s": statistics.fmean(scrape_s) if scrape_s else 0.0,
        "scrape_cpu": statistics.fmean(scrape_cpu) if scrape_cpu else 0.0,
    }


def summarise(per_step: dict[str, list[float]], extra_on: float = 0.0) -> dict[str, float]:
    """Throughput ratios from paired per-step costs: ``off / (off + d)`` where ``d`` is the
    median (robust) or the mean (counts rare costs such as flushes) of the per-cycle
    differences; ``extra_on`` (seconds per "on" step, e.g. the launcher's CPU) is added to d."""
    off = per_step["off"]
    base = statistics.median(off)
    mean_base = statistics.fmean(off)
    out = {"base": base}
    for arm in ("aa", "on"):
        diffs = [a - b for a, b in zip(per_step[arm], off, strict=True)]
        extra = extra_on if arm == "on" else 0.0
        med = statistics.median(diffs) + extra
        mean = statistics.fmean(diffs) + extra
        out[f"{arm}_median_d"] = med
        out[f"{arm}_mean_d"] = mean
        out[f"{arm}_median_ratio"] = base / (base + med)
        out[f"{arm}_mean_ratio"] = mean_base / (mean_base + mean)
        # Standard error of the mean difference: the spread of this run's estimate.
        out[f"{arm}_mean_se"] = statistics.stdev(diffs) / len(diffs) ** 0.5
    return out


WINDOW = re.compile(r"\[rank 0\].* samples/s ([0-9.]+)")


def run_job(mode: str, args: argparse.Namespace, workdir: Path) -> tuple[float, list[float], str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env["ELASTIC_TRAINER_METRICS"] = "0" if mode == "off" else "1"
    torchrun_args = [
        "--standalone", f"--nproc-per-node={args.nproc}", "--monitor-interval=0.5",
        "-m", "elastic_trainer.examples.synthetic_cnn",
        "--max-steps", str(args.max_steps), "--epochs", "100000",
        "--global-batch-size", str(args.global_batch_size), "--width", str(args.width),
        "--dataset-size", "4096", "--log-every", str(args.log_every),
        "--checkpoint-dir", str(workdir / f"ckpt-{mode}-{time.monotonic_ns()}"),
        "--checkpoint-every", str(args.max_steps + 1),  # only the final one, outside the windows
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHER, mode, str(args.scrape_interval), *torchrun_args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{output[-3000:]}")
    windows = [float(m.group(1)) for m in WINDOW.finditer(output)]
    if len(windows) < 4:
        raise SystemExit(f"{mode} run logged too few throughput windows: {windows}")
    scrapes = re.search(r"SCRAPES (\d+)", output)
    return statistics.median(windows[2:]), windows[2:], scrapes.group(1) if scrapes else "-"


def micro_costs() -> tuple[float, float, float]:
    """CPU seconds (best of N) per tiny-model DDP step at torch's sampling rate and at the
    observer's (one bucket, world size 1: DDP's timing of sampled backwards is all that differs),
    and per observer ``on_step``, in multiprocess mode."""
    with tempfile.TemporaryDirectory() as directory:
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=directory, RANK="0", LOCAL_RANK="0",
                   OMP_NUM_THREADS="1")  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-c", MICRO, "2000", "9"],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=True,
        )  # fmt: skip
    off, sampled, observer = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
    return off, sampled, observer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_arguments(parser, width=32, cnn_batch=128)
    parser.add_argument(
        "--nproc", type=int, default=None, help="workers (default: 2 on CPU, one per GPU on cuda)"
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=15.0,
        help="seconds between scrapes (default 15, as docker/prometheus.yml)",
    )
    parser.add_argument(
        "--cycles", type=int, default=1500, help="interleaved cycles per run (one step per arm)"
    )
    parser.add_argument(
        "--warmup", type=int, default=50, help="cycles left out at the start of a run"
    )
    parser.add_argument(
        "--rebuild-every",
        type=int,
        default=100,
        help="cycles between rebuilds of every arm's model (memory placement bias)",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="interleaved runs (fresh processes each)"
    )
    parser.add_argument(
        "--no-allreduce",
        dest="time_allreduce",
        action="store_false",
        help="'on' without the allreduce timing (ELASTIC_TRAINER_METRICS_ALLREDUCE=0)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="'on' times allreduces through the flight recorder (ELASTIC_TRAINER_METRICS_ALLREDUCE="
        "trace; CUDA): the recorder is on for every arm, each arm on its own process group",
    )
    parser.add_argument(
        "--end-to-end", action="store_true", help="also time whole torchrun jobs, off vs on"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="end to end: off/on pairs (default 3)"
    )
    parser.add_argument("--max-steps", type=int, default=800, help="end to end: steps per job")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--skip-micro", action="store_true", help="leave out the single-process CPU costs"
    )
    args = parser.parse_args()
    if args.rebuild_every <= REBUILD_SETTLE:
        parser.error(
            f"--rebuild-every must be more than the {REBUILD_SETTLE} settling cycles after a rebuild"
        )
    resolve_workload_arguments(parser, args)
    if args.trace and not args.time_allreduce:
        parser.error("--trace and --no-allreduce exclude each other")
    cuda = args.device == "cuda"
    workers = "gloo workers"
    if cuda:
        import torch

        workers = f"NCCL workers on {torch.cuda.get_device_name()}"
        args.skip_micro = True  # the micro costs are a CPU (gloo) measurement
        if args.end_to_end:
            parser.error(
                "--end-to-end times the CPU example job; it does not run with --device cuda"
            )

    what = (f"synthetic_cnn width {args.width}" if args.model == "cnn"
            else f"GPT-2-small-shaped decoder, {args.layers} layers, {args.seq_len} tokens per sample")  # fmt: skip
    print(
        f"{what}, global batch {args.global_batch_size}{', bf16 autocast' if args.bf16 else ''}, "
        f"{args.nproc} {workers}, "
        f"OMP_NUM_THREADS=1, scrape every {args.scrape_interval:g}s, allreduce timing "
        f"{'flight recorder' if args.trace else 'sampled' if args.time_allreduce else 'off'}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    if cuda:
        print(
            "on CUDA every step ends in loss.item(): the wall ratio is the throughput ratio (host CPU time "
            "includes the spin while waiting for the GPU)"
        )
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    print(
        f"\n== interleaved: {args.repeat} runs x {args.cycles} cycles (+{args.warmup} warm-up), one step "
        f"per arm per cycle, rotated order, models rebuilt every {args.rebuild_every} cycles =="
    )
    print(
        "ratio = throughput on/off = off / (off + d), d = per-cycle extra cost of the arm; median d is"
    )
    print(
        "robust to other tenants, mean d also counts rare costs (flushes, scrapes); +- 1 standard error"
    )
    header = (
        f"{'run':>3} {'load':>5} {'wall ms/step':>12} {'node CPU ms/step':>16} {'CPU on/off median':>17} {'CPU on/off mean':>21} "
        f"{'A/A CPU mean':>19} {'wall on/off median':>18} {'A/A wall median':>15}"
    )
    print(header)
    cpu_medians, cpu_means, aa_means, wall_medians, extras = [], [], [], [], []
    for run in range(args.repeat):
        load = os.getloadavg()[0]
        result = run_interleaved(args)
        wall = summarise(result["wall"])
        # The node endpoint costs CPU per scrape, not per step: spread over the steps a plain
        # job would run between two scrapes.
        endpoint_per_step = result["scrape_cpu"] * wall["base"] / args.scrape_interval
        cpu = summarise(result["cpu"], extra_on=endpoint_per_step)
        cpu_medians.append(cpu["on_median_ratio"])
        cpu_means.append(cpu["on_mean_ratio"])
        aa_means.append(cpu["aa_mean_ratio"])
        wall_medians.append(wall["on_median_ratio"])
        extras.append((cpu["on_median_d"], cpu["on_mean_d"], result["observer_median_s"], result["observer_mean_s"],
                       endpoint_per_step, result["scrapes"], result["scrape_cpu"]))  # fmt: skip
        se = cpu["on_mean_se"] / (cpu["base"] + cpu["on_mean_d"])
        aa_se = cpu["aa_mean_se"] / (cpu["base"] + cpu["aa_mean_d"])
        print(
            f"{run + 1:>3} {load:>5.1f} {wall['base'] * 1e3:>12.2f} {cpu['base'] * 1e3:>16.2f} {cpu['on_median_ratio']:>17.4f} "
            f"{cpu['on_mean_ratio']:>13.4f} +- {se:.4f} {cpu['aa_mean_ratio']:>11.4f} +- {aa_se:.4f} "
            f"{wall['on_median_ratio']:>18.4f} {wall['aa_median_ratio']:>15.4f}",
            flush=True,
        )

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.4f} (runs {min(values):.4f}-{max(values):.4f})"

    print(f"CPU on/off, median d: {spread(cpu_medians)}")
    print(f"CPU on/off, mean d:   {spread(cpu_means)}   A/A: {spread(aa_means)}")
    print(f"wall on/off, median d: {spread(wall_medians)}")
    med_d, mean_d, obs_med, obs_mean, endpoint, scrapes, scrape_cpu = (
        statistics.median(v) for v in zip(*extras, strict=True)
    )
    print(
        f"per step and rank (medians over runs): extra CPU {med_d / args.nproc * 1e6:.0f} us (median d) / "
        f"{mean_d / args.nproc * 1e6:.0f} us (mean d); time inside observer.on_step {obs_med * 1e6:.1f} us "
        f"median, {obs_mean * 1e6:.1f} us mean (flushes included); endpoint {scrape_cpu * 1e3:.1f} ms CPU "
        f"per scrape ({scrapes:.0f} per run) = {endpoint / args.nproc * 1e6:.1f} us per step and rank"
    )

    if args.end_to_end:
        print(f"\n== end to end: example job under torchrun, {args.max_steps} steps per run ==")
        print(
            f"{'round':>5} {'off samples/s':>14} {'on samples/s':>13} {'on/off':>7} {'scrapes':>8}"
        )
        offs, ons, ratios = [], [], []
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                outcome = {mode: run_job(mode, args, Path(tmp)) for mode in order}
                off, on = outcome["off"][0], outcome["on"][0]
                offs.append(off)
                ons.append(on)
                ratios.append(on / off)
                print(
                    f"{r + 1:>5} {off:>14.1f} {on:>13.1f} {on / off:>7.3f} {outcome['on'][2]:>8}",
                    flush=True,
                )
        print(f"median of per-round ratios: {spread(ratios)}")

    if not args.skip_micro:
        off_s, sampled_s, observer_s = micro_costs()
        print("\n== CPU cost, best of 9 (single process, world size 1, tiny model) ==")
        print(
            f"DDP's sampled timing {(sampled_s - off_s) * 1e6:.1f} us per step ({off_s * 1e6:.0f} -> "
            f"{sampled_s * 1e6:.0f} us per step); observer on_step {observer_s * 1e6:.1f} us per step"
        )


if __name__ == "__main__":
    main()
