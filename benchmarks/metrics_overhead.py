"""Training throughput with metrics on vs off, side by side (goal: on/off >= 0.99).

Runs the runtime's example job (``elastic_trainer.examples.synthetic_cnn``) under torchrun
(``--standalone``, gloo on CPU) in both modes, interleaved (off/on, then on/off, ...) so that
drift of a shared machine hits both:

- off: ``ELASTIC_TRAINER_METRICS=0`` (the trainer uses a NullObserver, no comm hook);
- on:  the launcher calls ``start_launcher_metrics`` (multiprocess directory, node endpoint,
  torch elastic handlers), workers record through ``worker_observer()`` with the allreduce
  timing hook, and a scraper thread GETs ``/metrics`` every ``--scrape-interval`` seconds.

Throughput of a run is the median of rank 0's logged ``samples/s`` windows after the first
two (warm-up). Separate runs drift on a shared machine, so a second measurement pairs the modes
inside the same processes:

- paired blocks: two gloo workers hold the example's model twice (same weights), one plain DDP
  with a NullObserver, one with ``worker_observer()`` and the comm hook, and alternate blocks of
  steps in ABBA order on the example's data; the launcher side (``start_launcher_metrics``) runs
  in the parent, which scrapes ``/metrics`` only while an "on" block runs. It also reports
  each mode's CPU seconds (all ranks; the launcher's CPU charged to "on"), which other
  tenants of the machine disturb far less than wall time.

Last, the CPU cost of the timing hook per bucket and of the observer per step (best of 9, one
process, tiny model), giving the bound 1 - cost / step time for the example's one-bucket step.

Usage::

    python benchmarks/metrics_overhead.py --rounds 3 --max-steps 800 --blocks 9
    python benchmarks/metrics_overhead.py --scrape-interval 1   # scrape stress
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

LAUNCHER = """
import sys, threading, urllib.request
import torch.distributed.run as torchrun
mode, interval, args = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
if mode == "off":
    torchrun.main(args)
else:
    from elastic_trainer.metrics import LauncherMetricsConfig, start_launcher_metrics
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
from elastic_trainer.metrics import worker_observer
from elastic_trainer.metrics_comm_hook import AllreduceTimer, timed_allreduce_hook
steps, reps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
# A tiny model (one bucket, ~20 us of math) so that the hook's fixed cost is a visible share.
models = {}
for kind in ("off", "hook"):
    torch.manual_seed(0)
    models[kind] = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
models["hook"].register_comm_hook(AllreduceTimer(), timed_allreduce_hook)
x = torch.randn(4, 16)
best = {k: float("inf") for k in models}
for _ in range(reps):  # best of N: other tenants only ever add time
    for kind, model in models.items():
        t = time.process_time()
        for _ in range(steps):
            model(x).sum().backward()
        best[kind] = min(best[kind], (time.process_time() - t) / steps)
obs = worker_observer()
obs.on_start(world_size=2, restart_count=0)
timer = AllreduceTimer()
obs._timer = timer  # what wrap_ddp installs, without a DDP model
obs_best = float("inf")
for _ in range(reps):
    t = time.process_time()
    for step in range(steps):
        now = time.monotonic()
        timer.record_cpu(timer.step_seq, 1 << 20, now, now + 0.001)
        obs.on_step(step=step, duration_s=0.03, data_wait_s=0.001, samples=64, tokens=0, loss=1.0)
    obs_best = min(obs_best, (time.process_time() - t) / steps)
print(best["off"], best["hook"], obs_best)
"""

def paired_worker(rank: int, world: int, port: int, args: argparse.Namespace, on_block: Any,
                  results: Any) -> None:
    """One worker of the paired-blocks measurement (torch.multiprocessing spawn target)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), TORCHELASTIC_RUN_ID="bench")  # fmt: skip
    import torch
    import torch.distributed as dist

    from elastic_trainer.examples.synthetic_cnn import SmallCNN, SyntheticImages
    from elastic_trainer.metrics import worker_observer
    from elastic_trainer.observer import NullObserver, TrainingObserver

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    per_rank = args.global_batch_size // world
    data = SyntheticImages(4096, seed=0)
    batches = [
        (data.images[i : i + per_rank], data.labels[i : i + per_rank])
        for i in range(rank * per_rank, 4096 - per_rank, world * per_rank)
    ]
    setups: dict[str, tuple[Any, TrainingObserver, Any]] = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(SmallCNN(args.width))
        observer: TrainingObserver = NullObserver()
        if mode == "on":
            metrics = worker_observer()
            if args.paired_on in ("all", "observer"):
                observer = metrics
            if args.paired_on in ("all", "hook"):
                metrics.wrap_ddp(ddp)
        observer.on_start(world_size=world, restart_count=0)
        setups[mode] = (ddp, observer, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))
    times: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, float] = {"off": 0.0, "on": 0.0}
    order = [m for _ in range(args.blocks) for m in ("off", "on", "on", "off")]
    step = 0
    for block, mode in enumerate(order):
        ddp, observer, opt = setups[mode]
        dist.barrier()
        if rank == 0:
            (on_block.set if mode == "on" else on_block.clear)()
        started, cpu_started = time.perf_counter(), time.process_time()
        for _ in range(args.block_steps):
            t0 = time.monotonic()
            x, y = batches[step % len(batches)]
            wait = time.monotonic() - t0
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            observer.on_step(step=step, duration_s=time.monotonic() - t0, data_wait_s=wait,
                             samples=len(y), tokens=0, loss=loss.item())  # fmt: skip
        elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        dist.barrier()
        if block >= 4:  # the first ABBA group warms up
            times[mode].append(elapsed)
            cpu[mode] += cpu_s  # this process and its threads (gloo, hook callbacks)
    on_block.clear()
    results.put((rank, times, cpu))
    dist.destroy_process_group()


def run_paired(args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's block times, all ranks' CPU seconds per mode, the launcher's CPU seconds and
    the scrapes done; see the module docstring."""
    import threading
    import urllib.request

    import torch.multiprocessing as mp

    from elastic_trainer.metrics import LauncherMetricsConfig, start_launcher_metrics

    ctx = mp.get_context("spawn")
    on_block, results = ctx.Event(), ctx.Queue()
    config = LauncherMetricsConfig(addr="127.0.0.1", port=0, run_id="bench")
    with start_launcher_metrics(config) as handle:
        stop, scrape_s = threading.Event(), []

        def scrape() -> None:
            while not stop.is_set():
                if not on_block.wait(0.1):
                    continue
                t0 = time.perf_counter()
                with urllib.request.urlopen(handle.url, timeout=10) as response:
                    response.read()
                scrape_s.append(time.perf_counter() - t0)
                stop.wait(args.scrape_interval)

        thread = threading.Thread(target=scrape, daemon=True)
        thread.start()
        launcher_cpu = time.process_time()
        try:
            mp.start_processes(paired_worker, args=(args.nproc, free_port(), args, on_block, results),
                               nprocs=args.nproc, start_method="spawn")  # fmt: skip
        finally:
            stop.set()
            thread.join()
        launcher_cpu = time.process_time() - launcher_cpu
    reports = sorted(results.get(timeout=10) for _ in range(args.nproc))
    return {
        "off": reports[0][1]["off"],
        "on": reports[0][1]["on"],
        "cpu_off": sum(r[2]["off"] for r in reports),
        "cpu_on": sum(r[2]["on"] for r in reports),
        "launcher_cpu": launcher_cpu,
        "scrapes": len(scrape_s),
        "scrape_s": statistics.fmean(scrape_s) if scrape_s else 0.0,
    }


def free_port() -> int:
    # Not rendezvous.etcd_server.free_port: benchmarks/rendezvous.py shadows that package here.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    """CPU seconds (best of N) per tiny-model DDP step without and with the timing hook (one
    bucket, world size 1: the hook's own machinery is all that differs), and per observer
    ``on_step`` with one bucket's timing, in multiprocess mode."""
    with tempfile.TemporaryDirectory() as directory:
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=directory, RANK="0", LOCAL_RANK="0",
                   OMP_NUM_THREADS="1")  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-c", MICRO, "2000", "9"],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=True,
        )  # fmt: skip
    off, hook, observer = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
    return off, hook, observer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="off/on pairs (default 3)")
    parser.add_argument("--max-steps", type=int, default=800)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--scrape-interval", type=float, default=15.0,
                        help="seconds between scrapes when on (default 15, as docker/prometheus.yml)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--blocks", type=int, default=9, help="ABBA groups (the first warms up)")
    parser.add_argument("--block-steps", type=int, default=50, help="steps per block")
    parser.add_argument("--skip-end-to-end", action="store_true", help="only the paired measurement")
    parser.add_argument("--paired-on", choices=("all", "hook", "observer", "none"), default="all",
                        help="what 'on' enables in the paired measurement (attribute a cost; none: A/A)")
    args = parser.parse_args()

    print(f"synthetic_cnn width {args.width}, global batch {args.global_batch_size}, {args.nproc} gloo workers, "
          f"OMP_NUM_THREADS=1, scrape every {args.scrape_interval:g}s when on")
    step_s = None
    if not args.skip_end_to_end:
        print(f"\n== end to end: example job under torchrun, {args.max_steps} steps per run ==")
        print(f"{'round':>5} {'off samples/s':>14} {'on samples/s':>13} {'on/off':>7} {'scrapes':>8}")
        offs, ons, ratios = [], [], []
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                result = {mode: run_job(mode, args, Path(tmp)) for mode in order}
                off, on = result["off"][0], result["on"][0]
                offs.append(off)
                ons.append(on)
                ratios.append(on / off)
                print(f"{r + 1:>5} {off:>14.1f} {on:>13.1f} {on / off:>7.3f} {result['on'][2]:>8}", flush=True)
        print(f"{'median':>5} {statistics.median(offs):>14.1f} {statistics.median(ons):>13.1f} "
              f"{statistics.median(ons) / statistics.median(offs):>7.3f}")
        print(f"median of per-round ratios: {statistics.median(ratios):.3f}")
        step_s = args.global_batch_size / statistics.median(offs)

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    print(f"\n== paired blocks ({args.paired_on} on): same processes, {args.blocks - 1} ABBA groups (+1 warm-up) of {args.block_steps}-step blocks ==")
    paired = run_paired(args)
    off_t, on_t = paired["off"], paired["on"]
    samples = args.block_steps * args.global_batch_size
    off_tp, on_tp = samples / statistics.median(off_t), samples / statistics.median(on_t)
    # Each ABBA group cancels a linear drift: its ratio is (off + off) / (on + on) block time.
    groups = [(off_t[i] + off_t[i + 1]) / (on_t[i] + on_t[i + 1]) for i in range(0, len(off_t) - 1, 2)]
    print(f"off {off_tp:.1f} samples/s, on {on_tp:.1f} samples/s (medians of {len(off_t)} blocks each)")
    print(f"on/off per ABBA group: {' '.join(f'{g:.3f}' for g in groups)}")
    print(f"best block: off {min(off_t):.3f} s, on {min(on_t):.3f} s -> on/off {min(off_t) / min(on_t):.3f}")
    print(f"on/off = {statistics.median(groups):.3f} (median over groups); "
          f"{paired['scrapes']} scrapes during on blocks, {paired['scrape_s'] * 1e3:.1f} ms each")
    # CPU seconds hardly move with other tenants' load: the cost of metrics in CPU terms, with
    # all of the launcher's CPU during the run (scrapes, endpoint) charged to "on".
    cpu_off, cpu_on = paired["cpu_off"], paired["cpu_on"] + paired["launcher_cpu"]
    print(f"CPU seconds (all ranks): off {cpu_off:.2f}, on {paired['cpu_on']:.2f} + launcher "
          f"{paired['launcher_cpu']:.2f} -> CPU ratio off/on = {cpu_off / cpu_on:.3f}")
    if step_s is None:
        step_s = args.global_batch_size / off_tp

    off_s, hook_s, observer_s = micro_costs()
    per_bucket = max(0.0, hook_s - off_s)
    cost = per_bucket + observer_s  # the example's ~100 KB of gradients fit in one bucket
    print("\n== CPU cost, best of 9 (single process, world size 1, tiny model) ==")
    print(f"timing hook {per_bucket * 1e6:.0f} us per bucket ({off_s * 1e6:.0f} -> {hook_s * 1e6:.0f} us "
          f"per step); observer on_step {observer_s * 1e6:.0f} us per step")
    print(f"one bucket per step: {cost * 1e6:.0f} us per {step_s * 1e3:.1f} ms step -> on/off bound "
          f"{1 - cost / step_s:.4f}")

if __name__ == "__main__":
    main()
