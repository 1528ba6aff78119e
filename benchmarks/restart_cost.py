"""What a process restart costs against healing in place, each part timed (issue 19).

Restart: every repeat starts a fresh interpreter (``sys.executable -c``) that times, with
``time.perf_counter`` / ``time.process_time`` inside itself, (1) interpreter start + ``import
torch`` (from the parent's spawn stamp), (2) the device context (cuda: ``torch.cuda.init`` + first
allocation + synchronize; n/a on cpu), (3) the process group: connect to the job's store (a
TCPStore the parent hosts for the whole run, as etcd outlives a worker), ``init_process_group``
on a fresh prefix, world size 1, and a first allreduce, (4) the state: ``torch.load(...,
weights_only=True)`` of the checkpoint file the parent wrote beforehand. The file is in the page
cache (it cannot be dropped without root): the best case for a disk read.

In place: the long-lived parent already has torch, the context and a group; it times (3')
``destroy_process_group`` + ``init_process_group`` on a fresh prefix of the same store + a first
allreduce. (4') the state from a live peer is what the healer does (``share_state``: the
structure serialised, the tensors' bytes in one broadcast over a host gloo group), timed on the
receiver of two spawned ranks, with a raw ``dist.broadcast`` of the tensors beside it (transport
alone, the lower bound); on cuda both ranks share the one GPU (gloo carries the bytes), and a
device-to-device clone of the state is printed too, the lower bound of a GPU peer copy.
The state is ``--state-mb`` of float32 parameters plus AdamW-like moments (2x): 3x on disk.

    python -m benchmarks.restart_cost --repeats 3
    python -m benchmarks.restart_cost --repeats 3 --device cuda

CPU seconds (``time.process_time``, all threads) are printed beside wall seconds: on a shared
machine they are the contention-free cost; the in-place state's CPU is both ranks' together.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_trainer.heal.state_transfer import share_state

HOST = "127.0.0.1"
STORE_TIMEOUT = timedelta(seconds=60)

# The restart child: only the standard library and torch, as a restarted worker starts.
CHILD = r"""
import time
wall0, p0 = time.time(), time.perf_counter()
import datetime, json, sys
import torch
import torch.distributed as dist
spawned, device, backend, host, port, prefix, path = sys.argv[1:8]
out = {"start_s": wall0 - float(spawned), "import_only_s": time.perf_counter() - p0,
       "import_s": time.time() - float(spawned), "import_cpu_s": time.process_time()}
def sync():
    if device == "cuda":
        torch.cuda.synchronize()
def phase(name, fn):
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    out[name + "_s"], out[name + "_cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
def context():
    torch.cuda.init(); torch.cuda.set_device(0); torch.empty(1, device="cuda"); sync()
def group():
    timeout = datetime.timedelta(seconds=60)
    store = dist.PrefixStore(prefix, dist.TCPStore(host, int(port), None, False, timeout=timeout))
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    dist.all_reduce(torch.ones(1, device=device)); sync()
def load():
    torch.load(path, map_location=device, weights_only=True); sync()
if device == "cuda":
    phase("context", context)
phase("group", group)
phase("load", load)
dist.destroy_process_group()
print(json.dumps(out), flush=True)
"""


def make_state(state_mb: float, tensor_mb: float) -> dict[str, Any]:
    """float32 parameters of ``state_mb`` MB in tensors of ``tensor_mb`` MB, and two AdamW moments."""
    numel, chunk = int(state_mb * 1e6 / 4), max(1, int(tensor_mb * 1e6 / 4))
    sizes = [min(chunk, numel - start) for start in range(0, numel, chunk)]
    model = {f"layer{i}.weight": torch.rand(n) for i, n in enumerate(sizes)}
    moments = {
        k: {"exp_avg": torch.rand(n), "exp_avg_sq": torch.rand(n)}
        for k, n in zip(model, sizes, strict=True)
    }
    return {"model": model, "optimizer": {"state": moments, "step": 1000}, "step": 1000}


def restart_once(args: argparse.Namespace, port: int, prefix: str, path: str) -> dict[str, float]:
    """One fresh child through every restart phase; its JSON plus the parent-measured wall time."""
    spawned = time.time()
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, repr(spawned), args.device, args.backend, HOST, str(port),
                               prefix, path], capture_output=True, text=True, timeout=args.timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"restart child did not finish in {args.timeout:g} s (killed)") from None
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise RuntimeError(f"restart child exited {proc.returncode}: {last}")
    out: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


def rebuild_once(args: argparse.Namespace, store: dist.Store, prefix: str) -> tuple[float, float]:
    """In place: destroy the group, create one on a fresh prefix, first allreduce (wall, CPU)."""
    wall, cpu = time.perf_counter(), time.process_time()
    dist.destroy_process_group()
    dist.init_process_group(args.backend, store=dist.PrefixStore(prefix, store), rank=0, world_size=1,
                            timeout=STORE_TIMEOUT)  # fmt: skip
    dist.all_reduce(torch.ones(1, device=args.device))
    if args.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu


def _peer(rank: int, port: int, args: argparse.Namespace, path: str, out: str) -> None:
    """One of two ranks: rank 0 holds the state (host tensors), rank 1 receives it ``--repeats``
    times through ``share_state``, then as a raw ``dist.broadcast`` of each tensor into tensors it
    already has (transport only: no serialisation, no allocation); each rank writes its [wall,
    CPU, raw wall, raw CPU] per repeat to ``out.<rank>``."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.empty(1, device=device)  # the context is up before anything is timed
    store = dist.PrefixStore("peers", dist.TCPStore(HOST, port, None, False, timeout=STORE_TIMEOUT))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=STORE_TIMEOUT)
    try:
        buffers = torch.load(
            path, weights_only=True
        )  # rank 1: only the shapes matter (overwritten)
        payload = buffers if rank == 0 else None
        times: list[list[float]] = []
        for _ in range(args.repeats):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            share_state(payload, src=0, device=device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append([time.perf_counter() - wall, time.process_time() - cpu])
            dist.barrier()  # the source's time ends when the receiver has its copy too
            wall, cpu = time.perf_counter(), time.process_time()
            for tensor in _tensors(buffers):
                dist.broadcast(tensor, src=0)
            times[-1] += [time.perf_counter() - wall, time.process_time() - cpu]
            dist.barrier()
        Path(f"{out}.{rank}").write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def peer_transfer(args: argparse.Namespace, port: int, path: str, tmp: str) -> list[list[float]]:
    """Per repeat: share_state's receiver wall, CPU of both ranks, then the same for the raw
    broadcast; from two spawned ranks, bounded by --timeout."""
    out = os.path.join(tmp, "peer")
    context = mp.start_processes(
        _peer, args=(port, args, path, out), nprocs=2, start_method="spawn", join=False
    )
    deadline = time.monotonic() + args.timeout
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"peer transfer did not finish in {args.timeout:g} s (killed)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    source, receiver = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    return [
        [rx[0], rx[1] + tx[1], rx[2], rx[3] + tx[3]]
        for tx, rx in zip(source, receiver, strict=True)
    ]


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--state-mb", type=float, default=200.0, help="float32 parameters, MB (checkpoint: 3x)"
    )
    parser.add_argument(
        "--tensor-mb", type=float, default=16.0, help="size of each parameter tensor, MB"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: gloo on cpu, nccl on cuda",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on each child run, s")
    parser.add_argument(
        "--tmp", default=None, help="directory for the checkpoint file (default: system temp)"
    )
    args = parser.parse_args()
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.repeats < 1 or args.state_mb <= 0 or args.tensor_mb <= 0 or args.timeout <= 0:
        parser.error("--repeats, --state-mb, --tensor-mb and --timeout must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    try:
        report(args)
    except (RuntimeError, OSError, mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        print(f"restart_cost.py: error: {str(exc).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    return 0


def report(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.empty(1, device=device)
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="restart-cost-") as tmp:
        path = os.path.join(tmp, "state.pt")
        state = make_state(args.state_mb, args.tensor_mb)
        torch.save(state, path)
        on_disk = os.path.getsize(path) / 1e6
        store = dist.TCPStore(HOST, 0, None, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
        dist.init_process_group(args.backend, store=dist.PrefixStore("parent-0", store), rank=0, world_size=1,
                                timeout=STORE_TIMEOUT)  # fmt: skip
        dist.all_reduce(torch.ones(1, device=device))
        restarts: list[dict[str, float]] = []
        rebuilds: list[tuple[float, float]] = []
        clones: list[float] = []
        try:
            for repeat in range(args.repeats):
                restarts.append(restart_once(args, store.port, f"restart-{repeat}", path))
                rebuilds.append(rebuild_once(args, store, f"parent-{repeat + 1}"))
                r = restarts[-1]
                print(
                    f"repeat {repeat}: restart child {r['process_s']:.2f} s (import {r['import_s']:.2f}, group "
                    f"{r['group_s']:.3f}, load {r['load_s']:.3f}); in-place group {rebuilds[-1][0]:.3f} s",
                    flush=True,
                )
            if device.type == "cuda":
                on_device = [t.to(device) for t in _tensors(state)]
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    copies = [t.clone() for t in on_device]
                    torch.cuda.synchronize()
                    clones.append(time.perf_counter() - started)
                    del copies
                del on_device
            del state
            peers = peer_transfer(args, store.port, path, tmp)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        print(
            f"peer state transfer (receiver): share_state {', '.join(f'{p[0]:.2f}' for p in peers)} s; "
            f"raw broadcast {', '.join(f'{p[2]:.2f}' for p in peers)} s",
            flush=True,
        )

    def med(key: str) -> float:
        return _median([r[key] for r in restarts])

    cuda = device.type == "cuda"
    rows: list[tuple[str, float | None, float, float | None, float]] = [
        ("1. interpreter start + `import torch`", med("import_s"), 0.0, med("import_cpu_s"), 0.0),
        (
            "2. device context",
            med("context_s") if cuda else None,
            0.0,
            med("context_cpu_s") if cuda else None,
            0.0,
        ),
        (
            f"3. process group ({args.backend})",
            med("group_s"),
            _median([w for w, _ in rebuilds]),
            med("group_cpu_s"),
            _median([c for _, c in rebuilds]),
        ),
        (
            "4. training state",
            med("load_s"),
            _median([p[0] for p in peers]),
            med("load_cpu_s"),
            _median([p[1] for p in peers]),
        ),
    ]
    where = torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)"
    print()
    print(
        f"{where}, backend {args.backend}, torch {torch.__version__}; state {args.state_mb:.0f} MB parameters + "
        f"2x AdamW moments = {on_disk:.0f} MB checkpoint; median of {args.repeats}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        "| phase | restart (s) | in place (s) | restart / in place | restart CPU (s) | in place CPU (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, restart, in_place, restart_cpu, in_place_cpu in rows:
        ratio = f"{restart / in_place:.1f}x" if restart is not None and in_place > 0 else "-"
        kept = "0 (kept)" if in_place == 0 else f"{in_place:.3f}"
        kept_cpu = "0 (kept)" if in_place_cpu == 0 else f"{in_place_cpu:.3f}"
        print(
            f"| {name} | {_cell(restart)} | {kept} | {ratio} | {_cell(restart_cpu)} | {kept_cpu} |"
        )
    total = sum(r[1] or 0.0 for r in rows)
    total_in_place = sum(r[2] for r in rows)
    total_cpu, total_in_place_cpu = sum(r[3] or 0.0 for r in rows), sum(r[4] for r in rows)
    print(
        f"| **total** | {total:.3f} | {total_in_place:.3f} | {total / total_in_place:.1f}x | {total_cpu:.3f} | "
        f"{total_in_place_cpu:.3f} |"
    )
    print()
    print(
        "2: CUDA init + first allocation + synchronize (n/a on cpu). 3: restart = connect to the store + "
        "init_process_group + first allreduce; in place = destroy_process_group + the same. 4: restart = "
        "torch.load of the page-cached checkpoint file; in place = share_state from a live peer (gloo, 2 ranks; "
        "CPU of both ranks)."
    )
    print(
        f"restart child as the parent saw it (spawn to exit, teardown included): {med('process_s'):.3f} s; "
        f"interpreter start alone {med('start_s'):.3f} s, `import torch` alone {med('import_only_s'):.3f} s"
    )
    print(
        f"4, transport alone (lower bound: raw gloo broadcast of the tensors into preallocated ones, host "
        f"memory): {_median([p[2] for p in peers]):.3f} s wall, {_median([p[3] for p in peers]):.3f} s CPU"
    )
    if cuda:
        print(
            f"lower bound for a GPU peer copy (device-to-device clone of the state on one GPU; two ranks cannot "
            f"share a GPU under NCCL): {_median(clones):.3f} s"
        )


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in state.values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            found += _tensors(value)
    return found


if __name__ == "__main__":
    sys.exit(main())
