"""The user script of ``benchmarks/launcher_e2e.py``: one job, as a bare DDP loop, through
``Trainer``, or as your own loop on ``Elastic``.

    torchrun --standalone --nproc-per-node 2 benchmarks/launcher_job.py --api bare --model mlp --width 1024 --out o
    elastic-trainer run --nproc-per-node 2 benchmarks/launcher_job.py --api trainer --model mlp --width 1024 --out o
    torchrun --standalone --nproc-per-node 1 benchmarks/launcher_job.py --api bare --device cuda --model gpt --out o

``bare``: the DDP guides' loop (``init_process_group``, ``DistributedSampler``, ``DataLoader``,
``DDP``, SGD). ``trainer``: the same model, data, loss and optimizer through ``Trainer`` with
everything at its default (under ``elastic-trainer run``: in-place healing, metrics, checkpoints
every 100 steps, the just-in-time save). ``elastic``: the README's ``Elastic`` snippet on the same
job, at every default. ``--device cuda``: NCCL and the GPU of ``LOCAL_RANK``
(the ``Trainer`` picks both itself when it sees a GPU), the decoder under bf16 autocast in both
(``workloads.uses_bf16``; the ``Trainer``'s ``mixed_precision="bf16"``), the GPU synchronised at
the steady window's two ends. Every rank writes ``OUT.RANK`` (JSON): the unix time of its first
finished step, the wall and CPU time (this process, every thread) of steps ``warmup..steps``, the
samples (and tokens) of a step, how many Python comm hooks its DDP has, how many threads it runs,
and how the Trainer's step control travelled (``gradient``: carried by DDP's buckets;
``collective``: its own).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED_UNIX = time.time()  # before torch's import: the interpreter's start is the launcher's

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.launcher_e2e import ENV_TREE_TAG  # noqa: E402
from benchmarks.workloads import Workload, autocast_of, uses_bf16, workload  # noqa: E402


def _job(args: argparse.Namespace) -> Workload:
    return workload(
        args.model,
        width=args.width,
        seq_len=args.seq_len,
        layers=args.layers,
        d_model=args.d_model,
        vocab=args.vocab,
        dataset_size=args.dataset_size,
    )


class Clock:
    """Stamps each finished step: (wall, process CPU); the first one's unix time too."""

    def __init__(self, total: int, warmup: int, *, cuda: bool = False) -> None:
        self.total = total
        self.warmup = warmup
        self.cuda = cuda
        """Synchronise the GPU before the window's first and last stamps: the window is GPU work done."""
        self.threads = 0
        self.stamps: list[tuple[float, float]] = []
        self.first_unix: float | None = None
        self.hooks = -1
        self.control = "-"
        self.tree: list[dict[str, Any]] = []
        """Snapshots of the job's processes (:func:`tree_snapshot`) at the window's two ends."""

    def step(self, ddp: Any) -> None:
        if self.first_unix is None:
            from elastic_trainer.runtime import torch_compat
            from elastic_trainer.runtime.grad_carrier import ControlCarrier

            self.first_unix = time.time()
            self.hooks = len(torch_compat.comm_hooks(ddp))
            carried = isinstance(getattr(ddp, "module", None), ControlCarrier)
            self.control = "gradient" if carried else "collective"
        if self.cuda and len(self.stamps) + 1 in (self.warmup, self.total):
            torch.cuda.synchronize()
        if len(self.stamps) + 1 == self.warmup:
            self.threads = len(os.listdir("/proc/self/task"))  # in steady state
            self._snapshot()  # before the window's first stamp: its cost stays outside
        self.stamps.append((time.perf_counter(), time.process_time()))
        if len(self.stamps) == self.total:
            self._snapshot()

    def _snapshot(self) -> None:
        tag = os.environ.get(ENV_TREE_TAG)
        if tag and os.environ.get("RANK", "0") == "0":
            self.tree.append(tree_snapshot(tag))


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def tree_snapshot(tag: str) -> dict[str, Any]:
    """Every thread of every process whose environment holds ``LAUNCHER_E2E_TAG=tag``:
    ``[name, CPU ns (schedstat), voluntary, involuntary context switches]``."""
    marker = f"{ENV_TREE_TAG}={tag}".encode()
    processes: dict[str, Any] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if marker not in _read(f"/proc/{pid}/environ").split(b"\0"):
                continue
            cmdline = _read(f"/proc/{pid}/cmdline").split(b"\0")
            tids = os.listdir(f"/proc/{pid}/task")
        except (OSError, ValueError, IndexError):  # ended, or not ours
            continue
        threads: dict[str, Any] = {}
        for tid in tids:
            task = f"/proc/{pid}/task/{tid}"
            try:
                name = _read(f"{task}/comm").decode(errors="replace").strip()
                cpu_ns = int(_read(f"{task}/schedstat").split()[0])
                status = _read(f"{task}/status").decode().splitlines()
            except (OSError, ValueError, IndexError):  # a thread that ended: not the process
                continue
            switches = [int(line.split()[1]) for line in status if "ctxt_switches" in line]
            threads[tid] = [name, cpu_ns, *switches]
        processes[pid] = {
            "cmd": " ".join(part.decode(errors="replace") for part in cmdline[:6]),
            "threads": threads,
        }
    return {"monotonic": time.monotonic(), "processes": processes}


_KEPT: list[object] = []


def bare(args: argparse.Namespace, clock: Clock) -> object:
    """The DDP guides' loop; returns the DDP model, which the caller keeps until ``os._exit``:
    freeing it frees gloo's process group, whose destructor joins gloo's threads while holding the
    GIL that one of them may be waiting for (a hang at exit, seen in one run of 24)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    job = _job(args)
    model = DDP(job.model().to(device), device_ids=[device.index] if cuda else None)
    dataset = job.dataset()
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, drop_last=True
    )
    loader = DataLoader(
        dataset,
        batch_size=args.global_batch_size // world,
        sampler=sampler,
        drop_last=True,
        pin_memory=cuda,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    autocast = autocast_of(args)
    epoch = 0
    while len(clock.stamps) < clock.total:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if cuda:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = job.loss(model(x), y)
            loss.backward()
            optimizer.step()
            loss.item()  # what a loop that logs its loss does; Trainer reads it from the control
            clock.step(model)
            if len(clock.stamps) >= clock.total:
                break
        epoch += 1
    return model


def trainer(args: argparse.Namespace, clock: Clock) -> None:
    from elastic_trainer import Trainer, TrainerConfig, TrainingJob
    from elastic_trainer.checkpoint.config import CheckpointConfig
    from elastic_trainer.runtime.settings import ENV_CONTROL_CARRIER

    if args.control is not None:  # else the default: a gradient on the CPU
        os.environ[ENV_CONTROL_CARRIER] = "1" if args.control == "gradient" else "0"

    spec = _job(args)
    job = TrainingJob(
        model=spec.model,
        dataset=spec.dataset,
        loss=spec.loss,
        tokens_per_sample=spec.tokens_per_sample,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    )
    config = TrainerConfig(
        global_batch_size=args.global_batch_size,
        epochs=10_000,
        max_steps=clock.total,
        checkpoint=CheckpointConfig(
            directory=args.checkpoint_dir,
            **({"every": args.checkpoint_every} if args.checkpoint_every else {}),
        ),
        mixed_precision="bf16" if args.bf16 else "no",
    )
    Trainer(config, job, callbacks=[lambda t, step: clock.step(t.ddp)]).fit()


def own_loop(args: argparse.Namespace, clock: Clock) -> None:
    """The README's ``Elastic`` snippet on the same model, data, loss and optimizer: your own
    loop, everything at its default (the checkpoint directory as the ``trainer`` one)."""
    from elastic_trainer import Elastic

    spec = _job(args)
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = spec.model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    elastic = Elastic(
        model,
        spec.dataset(),
        global_batch_size=args.global_batch_size,
        max_steps=clock.total,
        epochs=10_000,
        checkpoint_dir=args.checkpoint_dir,
        **({"checkpoint_every": args.checkpoint_every} if args.checkpoint_every else {}),
        tokens_per_sample=spec.tokens_per_sample,
    )
    autocast = autocast_of(args)
    for step in elastic:
        with step:
            for x, y in step:
                with autocast():
                    loss = spec.loss(elastic.ddp(x), y)
                step.backward(loss * step.weight)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        clock.step(elastic.ddp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=("bare", "trainer", "elastic"), required=True)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo; cuda: NCCL, the GPU of LOCAL_RANK (the Trainer: CUDA whenever it sees one)",
    )
    parser.add_argument("--model", choices=("cnn", "mlp", "gpt"), default="cnn")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dataset-size", type=int, default=4096)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument(
        "--checkpoint-dir", default=None, help="trainer: default a temporary directory"
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="trainer: periodic checkpoints every this many steps (default: the Trainer's, 100)",
    )
    parser.add_argument(
        "--control",
        choices=("gradient", "collective"),
        default=None,
        help="trainer: the step's control as a gradient (the default) or on its own collective "
        "(ELASTIC_TRAINER_CONTROL_CARRIER=0)",
    )
    parser.add_argument("--out", required=True, help="each rank writes OUT.RANK")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "launcher_job: --device cuda: no CUDA device is visible\n")
    args.bf16 = uses_bf16(args.device, args.model)
    torch.set_num_threads(1)
    clock = Clock(args.steps, args.warmup, cuda=args.device == "cuda")
    if args.api == "bare":
        _KEPT.append(bare(args, clock))  # see bare(): never freed; os._exit ends the process
    else:
        with tempfile.TemporaryDirectory() as tmp:
            args.checkpoint_dir = args.checkpoint_dir or tmp
            (trainer if args.api == "trainer" else own_loop)(args, clock)
    window = clock.stamps[args.warmup - 1 :]
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{args.out}.{rank}").write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "started_unix": STARTED_UNIX,
                "first_step_unix": clock.first_unix,
                "steps": len(window) - 1,
                "device": args.device,
                "samples_per_step": args.global_batch_size,
                "tokens_per_sample": _job(args).tokens_per_sample,
                "wall_s": window[-1][0] - window[0][0],
                "cpu_s": window[-1][1] - window[0][1],
                "comm_hooks": clock.hooks,
                "control": clock.control,
                "threads": clock.threads,
                "step_ms": [round(1e3 * (b[0] - a[0]), 3) for a, b in itertools.pairwise(window)],
                "tree": clock.tree,
            }
        )
    )
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # torch 2.13's gloo can abort in interpreter teardown (runtime/process_exit.py)
