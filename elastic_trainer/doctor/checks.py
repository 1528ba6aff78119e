"""The checks of ``elastic-trainer doctor``, one function each.

Local checks take their inputs as arguments (environment mapping, device counts) so that unit
tests can feed them anything. Collective checks need the default process group and must be
called by every rank in the same order; each returns a :class:`CheckResult` and raises only when
a collective itself failed. Self-test faults (:data:`FAULTS`, ``ELASTIC_TRAINER_DOCTOR_FAULT``)
make the last rank misbehave on purpose. Design: ``docs/design/doctor.md``.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_trainer.doctor import perf
from elastic_trainer.doctor.report import FAIL, PASS, SKIP, WARN, CheckResult, format_size
from elastic_trainer.runtime import distributed
from elastic_trainer.runtime.failures import first_line
from elastic_trainer.runtime.settings import ENV_PG_TIMEOUT_S, WorkerSettings

log = logging.getLogger(__name__)

FAULT_ENV = "ELASTIC_TRAINER_DOCTOR_FAULT"
FAULTS = {
    "allreduce": "the last rank adds 1 to its allreduce contribution",
    "grad_sync": "the last rank adds 1 to a gradient after the DDP backward",
    "placement": "the last rank leaves its test batch on the meta device",
    "hang": "the last rank never joins the allreduce check",
}
"""Self-test faults, injected on the last rank only."""

TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
"""What torchrun sets for every worker and the doctor checks."""
_INT_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")
RUNTIME_TIMEOUT_ENV = (
    ENV_PG_TIMEOUT_S,
    distributed.NCCL_ASYNC_ERROR_HANDLING,
    distributed.NCCL_BLOCKING_WAIT,
    distributed.NCCL_ENABLE_MONITORING,
    distributed.NCCL_HEARTBEAT_TIMEOUT_SEC,
)
"""The timeout variables the runtime reads: the ranks' values are compared (they must agree)."""
TIMEOUT_ENV = (
    *RUNTIME_TIMEOUT_ENV,
    "NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT",
    "NCCL_TIMEOUT",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
)
"""What the timeouts check reads (and compares across ranks)."""

ALLREDUCE_ELEMENTS = 1 << 18
"""float32 elements in the correctness allreduce (1 MiB: several chunks in any ring)."""
GRAD_RTOL = 1e-3
"""DDP's gradients vs the mean of the ranks' local gradients: the summation orders differ."""
SPREAD_RTOL = 1e-5
"""Gradients after an allreduce are bit-identical on every rank in practice; this is slack."""
RATIO_WARN_BELOW = 1.0
"""compute/comm below this: the allreduce takes longer than forward+backward."""
RATIO_ADVISED = 10.0
"""The DDP guide's "computation >> communication (10:1 or better)"."""


def parse_faults(text: str) -> frozenset[str]:
    """``"allreduce,hang"`` -> the fault names. Raises ValueError naming an unknown one."""
    names = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(names - FAULTS.keys())
    if unknown:
        raise ValueError(f"{FAULT_ENV}: unknown fault {unknown[0]!r} (known: {', '.join(FAULTS)})")
    return names


# --- local checks ----------------------------------------------------------------------------


def check_env(environ: Mapping[str, str]) -> CheckResult:
    """torchrun's variables are all set, integers where they must be, and consistent."""
    values = {name: environ.get(name) or None for name in TORCHRUN_ENV}
    status, detail = _env_verdict(values)
    return CheckResult(name="env", status=status, detail=detail, data={"env": values})


def _env_verdict(values: Mapping[str, str | None]) -> tuple[str, str]:
    if values["RANK"] is None and values["WORLD_SIZE"] is None:
        return FAIL, (
            "not started by torchrun (RANK and WORLD_SIZE unset): run `elastic-trainer doctor` or "
            "`torchrun --nproc-per-node=N -m elastic_trainer.doctor`; checking this process alone"
        )
    problems = []
    missing = [name for name, value in values.items() if value is None]
    if missing:
        problems.append(f"unset: {', '.join(missing)}")
    nums: dict[str, int] = {}
    for name in _INT_ENV:
        raw = values[name]
        if raw is None:
            continue
        try:
            nums[name] = int(raw)
        except ValueError:
            problems.append(f"{name}={raw!r} is not an integer")
    problems += _env_range_problems(nums)
    if problems:
        return FAIL, "; ".join(problems)
    return PASS, (
        f"WORLD_SIZE {nums.get('WORLD_SIZE')}, LOCAL_WORLD_SIZE {nums.get('LOCAL_WORLD_SIZE')}, "
        f"every RANK/LOCAL_RANK in range, MASTER {values['MASTER_ADDR']}:{nums.get('MASTER_PORT')}, "
        f"run id {values['TORCHELASTIC_RUN_ID']}"
    )


def _env_range_problems(nums: Mapping[str, int]) -> list[str]:
    """What the integer variables that were set get wrong, alone or together."""
    problems = []
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        rank, size = nums.get(rank_var), nums.get(size_var)
        if size is not None and size < 1:
            problems.append(f"{size_var}={size} must be >= 1")
        if rank is not None and (rank < 0 or (size is not None and rank >= size)):
            problems.append(f"{rank_var}={rank} is not in 0..{size_var}-1 ({size_var}={size})")
    world, local_world = nums.get("WORLD_SIZE"), nums.get("LOCAL_WORLD_SIZE")
    if local_world is not None and world is not None and local_world > world:
        problems.append(f"LOCAL_WORLD_SIZE={local_world} exceeds WORLD_SIZE={world}")
    if nums.get("GROUP_RANK", 0) < 0:
        problems.append(f"GROUP_RANK={nums['GROUP_RANK']} must be >= 0")
    port = nums.get("MASTER_PORT")
    if port is not None and not 1 <= port <= 65535:
        problems.append(f"MASTER_PORT={port} is not a TCP port")
    return problems


@dataclass(kw_only=True, slots=True)
class BackendProbe:
    """What this torch build and machine offer."""

    distributed: bool
    gloo: bool
    nccl: bool
    cuda: bool
    nccl_version: str | None
    nccl_error: str | None = None


def probe_backend() -> BackendProbe:
    """Ask torch which backends exist, and NCCL's version when CUDA is present."""
    available = dist.is_available()
    cuda = torch.cuda.is_available()
    nccl = available and dist.is_nccl_available()
    version = error = None
    if cuda and nccl:
        try:
            raw = torch.cuda.nccl.version()
            version = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
        except Exception as exc:  # noqa: BLE001 - reported as the check's result
            error = first_line(exc)
    return BackendProbe(
        distributed=available,
        gloo=available and dist.is_gloo_available(),
        nccl=nccl,
        cuda=cuda,
        nccl_version=version,
        nccl_error=error,
    )


def check_backend(probe: BackendProbe) -> CheckResult:
    """The backend this node needs exists: NCCL (and its version) with CUDA, gloo without."""
    status, detail = _backend_verdict(probe)
    return CheckResult(name="backend", status=status, detail=detail, data=asdict(probe))


def _backend_verdict(probe: BackendProbe) -> tuple[str, str]:
    if not probe.distributed:
        return FAIL, "torch.distributed is not available in this torch build"
    if not probe.cuda:
        if not probe.gloo:
            return FAIL, "no CUDA and no gloo in this torch build: no backend can run here"
        return PASS, "gloo (used: no CUDA on this node, so NCCL is not needed)"
    if not probe.nccl:
        return (
            FAIL,
            "CUDA is present but this torch build has no NCCL: install a CUDA build of torch",
        )
    if probe.nccl_version is None:
        return FAIL, f"torch.cuda.nccl.version() failed: {probe.nccl_error}"
    if not probe.gloo:
        return WARN, (
            f"NCCL {probe.nccl_version} (used); gloo missing: CPU tensors cannot be communicated"
        )
    return PASS, f"NCCL {probe.nccl_version} (used with CUDA), gloo available"


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_devices(
    *,
    cuda_devices: int,
    local_world_size: int | None,
    local_rank: int | None,
    cpu_count: int,
    cuda_visible: str | None,
) -> CheckResult:
    """As many GPUs as local ranks (with CUDA); no CPU oversubscription (without)."""
    data = {
        "cuda_devices": cuda_devices,
        "local_world_size": local_world_size,
        "cpus": cpu_count,
        "CUDA_VISIBLE_DEVICES": cuda_visible,
    }
    if local_world_size is None or local_rank is None:
        status, detail = SKIP, "LOCAL_WORLD_SIZE/LOCAL_RANK unusable (see env)"
    elif cuda_devices > 0:
        status, detail = _gpus_verdict(cuda_devices, local_world_size, local_rank, cuda_visible)
    elif local_world_size > cpu_count:
        status = WARN
        detail = f"no CUDA: {local_world_size} local ranks share {cpu_count} CPU core(s): oversubscribed, timings will be poor"
    else:
        status = PASS
        detail = f"no CUDA: {local_world_size} local rank(s) on {cpu_count} CPU core(s), gloo"
    return CheckResult(name="devices", status=status, detail=detail, data=data)


def _gpus_verdict(
    cuda_devices: int, local_world_size: int, local_rank: int, cuda_visible: str | None
) -> tuple[str, str]:
    visible = f" (CUDA_VISIBLE_DEVICES={cuda_visible})" if cuda_visible is not None else ""
    if cuda_devices < local_world_size or local_rank >= cuda_devices:
        return FAIL, (
            f"LOCAL_WORLD_SIZE={local_world_size} but {cuda_devices} GPU(s) visible{visible}: start at most "
            f"{cuda_devices} workers per node (--nproc-per-node) or fix CUDA_VISIBLE_DEVICES"
        )
    if cuda_devices > local_world_size:
        return WARN, (
            f"{cuda_devices} GPUs visible{visible} but LOCAL_WORLD_SIZE={local_world_size}: "
            f"{cuda_devices - local_world_size} idle (--nproc-per-node={cuda_devices} uses them all)"
        )
    return PASS, (
        f"{cuda_devices} GPU(s) for {local_world_size} local rank(s), this rank on cuda:{local_rank}"
    )


def interface_matches(spec: str, interfaces: Sequence[str]) -> list[str]:
    """Interfaces selected by an ``NCCL_SOCKET_IFNAME`` value (NCCL's syntax: comma-separated
    prefixes, ``=`` for exact names, a leading ``^`` to exclude instead)."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    names = [part for part in spec.split(",") if part]

    def hit(interface: str) -> bool:
        return any(interface == name if exact else interface.startswith(name) for name in names)

    return [i for i in interfaces if hit(i) != exclude]


@contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def _error_handling_warnings(effective: Mapping[str, str]) -> list[str]:
    """What the NCCL error-handling variables in effect get wrong (a hang instead of an exit)."""
    warnings: list[str] = []
    async_mode = effective.get(distributed.NCCL_ASYNC_ERROR_HANDLING, "1").strip()
    blocking = effective.get(distributed.NCCL_BLOCKING_WAIT, "0").strip()
    if async_mode not in ("0", "1", "2", "3"):
        warnings.append(
            f"{distributed.NCCL_ASYNC_ERROR_HANDLING}={async_mode!r} is not one of 0..3"
        )
    elif async_mode == "0" and blocking != "1":
        warnings.append(
            f"{distributed.NCCL_ASYNC_ERROR_HANDLING}=0 without {distributed.NCCL_BLOCKING_WAIT}=1: "
            "a failed or timed-out NCCL collective hangs the rank instead of ending it, so torchrun "
            "never restarts the group (use 1, the runtime's default)"
        )
    if blocking == "1":
        warnings.append(
            f"{distributed.NCCL_BLOCKING_WAIT}=1: the CPU waits for every collective (no overlap of "
            f"communication with compute); the runtime relies on {distributed.NCCL_ASYNC_ERROR_HANDLING}=1"
        )
    return warnings


def _deprecated_names(environ: Mapping[str, str]) -> list[str]:
    """Variables under a deprecated name, or one nothing reads."""
    warnings: list[str] = []
    for legacy in ("NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT"):
        if legacy in environ:
            modern = "TORCH_" + legacy
            clash = (
                f" and disagrees with {modern}={environ[modern]!r}, which wins"
                if (modern in environ and environ[modern] != environ[legacy])
                else ""
            )
            warnings.append(f"{legacy} is the deprecated name of {modern}{clash}")
    if "NCCL_TIMEOUT" in environ:
        warnings.append(
            f"NCCL_TIMEOUT is read by neither NCCL nor PyTorch: the collective timeout is "
            f"{ENV_PG_TIMEOUT_S}"
        )
    return warnings


def _unmatched_interfaces(
    environ: Mapping[str, str], interfaces: Sequence[str] | None
) -> list[str]:
    """Socket interface variables that match no interface of this host."""
    warnings: list[str] = []
    for variable, exact in (("NCCL_SOCKET_IFNAME", False), ("GLOO_SOCKET_IFNAME", True)):
        spec = environ.get(variable, "").strip()
        if spec and interfaces is not None:
            chosen = interface_matches(
                ("=" + spec) if exact and not spec.startswith("=") else spec, interfaces
            )
            if not chosen:
                warnings.append(
                    f"{variable}={spec!r} matches no interface of this host "
                    f"({', '.join(interfaces) or 'none'}): its backend cannot connect"
                )
    return warnings


def check_timeouts(environ: Mapping[str, str], *, interfaces: Sequence[str] | None) -> CheckResult:
    """The collective timeout and the NCCL error-handling variables a training run would use
    agree: a failed rank ends in an exit (not a hang), and the heartbeat monitor never fires
    before the collective timeout. Unset values count as the runtime's defaults."""
    user = {name: environ[name] for name in TIMEOUT_ENV if name in environ}
    data: dict[str, object] = {"set": user}
    try:  # read as a worker reads it
        pg_timeout = WorkerSettings.from_environ(environ).pg_timeout_s
    except ValueError as exc:
        detail = f"{exc}: training refuses to start"
        return CheckResult(name="timeouts", status=FAIL, data=data, detail=detail)
    source = ENV_PG_TIMEOUT_S if environ.get(ENV_PG_TIMEOUT_S, "").strip() else "default"
    effective = dict(environ)
    with _quiet(distributed.log):  # the problems it logs are reported below, once, by rank 0
        distributed.configure_nccl_environment(pg_timeout, environ=effective)
    data.update(
        {"pg_timeout_s": pg_timeout, "effective": {n: effective.get(n) for n in TIMEOUT_ENV}}
    )
    heartbeat, heartbeat_warnings = _heartbeat(effective, pg_timeout, source)
    warnings = _error_handling_warnings(effective) + heartbeat_warnings
    warnings += _deprecated_names(environ) + _unmatched_interfaces(environ, interfaces)
    if warnings:
        return CheckResult(name="timeouts", status=WARN, detail="; ".join(warnings), data=data)
    async_mode = effective.get(distributed.NCCL_ASYNC_ERROR_HANDLING, "1").strip()
    detail = (
        f"collective timeout {pg_timeout:g} s ({source}); "
        f"{distributed.NCCL_ASYNC_ERROR_HANDLING}={async_mode}"
    )
    if heartbeat is not None:
        detail += f", {distributed.NCCL_HEARTBEAT_TIMEOUT_SEC}={heartbeat} >= timeout"
    for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if environ.get(variable):
            detail += f", {variable}={environ[variable]}"
    return CheckResult(name="timeouts", status=PASS, detail=detail, data=data)


def _heartbeat(
    effective: Mapping[str, str], pg_timeout: float, source: str
) -> tuple[int | None, list[str]]:
    """The heartbeat timeout in effect (``None``: unreadable, or the monitor is off) and what is
    wrong with it: not a number, or below the collective timeout."""
    raw = effective.get(distributed.NCCL_HEARTBEAT_TIMEOUT_SEC, "").strip()
    try:
        heartbeat = int(raw)
    except ValueError:
        return None, [
            f"{distributed.NCCL_HEARTBEAT_TIMEOUT_SEC}={raw!r} is not a whole number of seconds"
        ]
    if effective.get(distributed.NCCL_ENABLE_MONITORING, "1").strip() == "0":
        return None, []
    if heartbeat < pg_timeout:
        return heartbeat, [
            f"{distributed.NCCL_HEARTBEAT_TIMEOUT_SEC}={heartbeat} is below the collective timeout "
            f"{pg_timeout:g} s ({source}): the heartbeat monitor may abort a rank before a slow "
            "collective would have timed out; keep it >= the timeout"
        ]
    return heartbeat, []


def host_interfaces() -> list[str] | None:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return None


# --- the test model --------------------------------------------------------------------------


class DoctorCNN(nn.Module):
    """The doctor's own model (it never imports the examples): conv-BN-ReLU twice, pool, linear,
    the shape of a small image classifier, so placement, gradient sync and compute are exercised."""

    def __init__(self, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@dataclass(kw_only=True, slots=True)
class TestModel:
    """How to build the model the doctor trains one step of, and a batch for it."""

    __test__ = False  # not a pytest class

    build: Callable[[], nn.Module] = DoctorCNN
    source: str = "the doctor's CNN (conv-BN-ReLU x2, pool, linear)"
    classes: int = 10
    image_side: int = 16

    def batch(
        self, size: int, *, seed: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        images = torch.randn(size, 3, self.image_side, self.image_side, generator=generator)
        labels = torch.randint(0, self.classes, (size,), generator=generator)
        return images.to(device), labels.to(device)


@dataclass(kw_only=True, slots=True)
class Setup:
    """What the placement and collective checks take: this rank's place in the job, the model,
    the command line's measurement settings and the self-test faults injected on this rank."""

    rank: int
    world_size: int
    device: torch.device
    batch_size: int
    iters: int
    warmup: int
    sizes: list[int]
    model: TestModel = field(default_factory=TestModel)
    faults: frozenset[str] = frozenset()


def check_placement(
    model: nn.Module, inputs: torch.Tensor, target: torch.Tensor, device: torch.device
) -> CheckResult:
    """Every parameter, buffer, the batch, the output and the loss are on this rank's device
    (``cuda:LOCAL_RANK`` or ``cpu``), and so is the current CUDA device."""
    wrong = _off_device(device, dict(model.named_parameters()), "parameter ")
    wrong += _off_device(device, dict(model.named_buffers()), "buffer ")
    wrong += _off_device(device, {"batch": inputs, "target": target})
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        wrong.append(
            f"current CUDA device is cuda:{torch.cuda.current_device()} "
            "(call torch.cuda.set_device(LOCAL_RANK) before creating tensors)"
        )
    if not wrong:
        try:
            output = model(inputs)
            loss = nn.functional.cross_entropy(output, target)
        except RuntimeError as exc:
            wrong = [f"forward failed: {first_line(exc)}"]
        else:
            wrong = _off_device(device, {"output": output, "loss": loss})
    data = {"device": str(device), "misplaced": wrong}
    if wrong:
        shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        return CheckResult(
            name="placement", status=FAIL, data=data, detail=f"expected {device}: {shown}"
        )
    detail = (
        f"{sum(1 for _ in model.parameters())} parameters, {sum(1 for _ in model.buffers())} buffers, "
        f"batch {tuple(inputs.shape)}, output and loss all on {device}"
    )
    return CheckResult(name="placement", status=PASS, data=data, detail=detail)


def _off_device(
    device: torch.device, tensors: Mapping[str, torch.Tensor], kind: str = ""
) -> list[str]:
    """``"<kind><name> on <device>"`` for each of ``tensors`` that is not on ``device``."""
    return [f"{kind}{name} on {t.device}" for name, t in tensors.items() if t.device != device]


# --- collective checks (every rank, same order) ----------------------------------------------


def _spread(values: torch.Tensor) -> float:
    """Largest difference of any element between ranks (max over ranks minus min over ranks)."""
    high, low = values.detach().clone(), values.detach().clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return float((high - low).abs().max().item()) if values.numel() else 0.0


def check_allreduce(setup: Setup) -> CheckResult:
    """Each rank contributes its rank: the sum must be n(n-1)/2 everywhere, for an int64 scalar
    and for every element of a 1 MiB float32 tensor."""
    contribution = setup.rank + (1 if "allreduce" in setup.faults else 0)
    n = setup.world_size
    expected = n * (n - 1) // 2
    scalar = torch.tensor([contribution], dtype=torch.int64, device=setup.device)
    vector = torch.full(
        (ALLREDUCE_ELEMENTS,), float(contribution), dtype=torch.float32, device=setup.device
    )
    if "hang" in setup.faults:
        threading.Event().wait()  # never set: the doctor's deadline (or torchrun) ends the process
    dist.all_reduce(scalar)
    dist.all_reduce(vector)
    got = int(scalar.item())
    low, high = float(vector.min().item()), float(vector.max().item())
    data = {"expected": expected, "int64": got, "float32_min": low, "float32_max": high}
    if got == low == high == expected:
        status = PASS
        detail = f"sum of ranks = {expected} = n(n-1)/2 for n={n} (int64 and {ALLREDUCE_ELEMENTS} float32 elements)"
    else:
        status = FAIL
        shown = f"{low:g}" if low == high else f"{low:g}..{high:g}"
        detail = f"sum of ranks is {got} (int64) and {shown} (float32), expected n(n-1)/2 = {expected} for n={n}"
    return CheckResult(name="allreduce", status=status, data=data, detail=detail)


def _flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
            for p in module.parameters()
        ]
    )


def check_grad_sync(setup: Setup) -> CheckResult:
    """One DDP forward/backward with rank-dependent weights and inputs: after construction the
    weights must be rank 0's on every rank; after backward the gradients must be identical on
    every rank and equal to the mean of the ranks' local (non-DDP) gradients."""
    device, world_size = setup.device, setup.world_size
    torch.manual_seed(10_000 + setup.rank)  # weights differ per rank: DDP must broadcast rank 0's
    module = setup.model.build().to(device).train()
    ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
    params_spread = _spread(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
    reference = copy.deepcopy(module)  # same weights, no DDP: the local gradient of this rank
    inputs, target = setup.model.batch(setup.batch_size, seed=20_000 + setup.rank, device=device)

    nn.functional.cross_entropy(ddp(inputs), target).backward()
    if "grad_sync" in setup.faults:
        grad = next(p.grad for p in module.parameters() if p.grad is not None)
        grad.add_(1.0)
    synced = _flat_grads(module)
    nn.functional.cross_entropy(reference(inputs), target).backward()
    local = _flat_grads(reference)
    expected = local.clone()
    dist.all_reduce(expected)
    expected /= world_size
    scale = max(float(expected.abs().max().item()), 1e-12)
    local_spread = _spread(local)
    data = {
        "params_spread": params_spread,
        "grads_spread": _spread(synced),
        "local_grads_spread": local_spread,
        "max_rel_error_vs_mean": float((synced - expected).abs().max().item()) / scale,
        "parameters": int(synced.numel()),
    }
    status, detail = _grad_sync_verdict(data, scale=scale, world_size=world_size)
    return CheckResult(name="grad_sync", status=status, detail=detail, data=data)


def _grad_sync_verdict(
    data: Mapping[str, Any], *, scale: float, world_size: int
) -> tuple[str, str]:
    params_spread, grads_spread = data["params_spread"], data["grads_spread"]
    local_spread, error = data["local_grads_spread"], data["max_rel_error_vs_mean"]
    problems = []
    if params_spread > 0:
        problems.append(
            f"weights differ between ranks by up to {params_spread:.3g} after DDP construction "
            "(rank 0's weights were not broadcast)"
        )
    if grads_spread > SPREAD_RTOL * scale:
        problems.append(
            f"gradients differ between ranks by up to {grads_spread:.3g} after backward"
        )
    if error > GRAD_RTOL:
        problems.append(
            f"gradients differ from the mean of the ranks' local gradients "
            f"(max relative error {error:.3g} > {GRAD_RTOL:g})"
        )
    if problems:
        return FAIL, "; ".join(problems)
    if world_size > 1 and local_spread == 0:
        return WARN, (
            "gradients agree, but the ranks' local gradients were identical too, so synchronisation went unproven"
        )
    return PASS, (
        f"weights broadcast from rank 0; {data['parameters']} gradients identical on every rank and equal to "
        f"the mean of the local ones (max relative error {error:.1g}; local gradients differed by up to "
        f"{local_spread:.3g})"
    )


def check_bandwidth(setup: Setup) -> CheckResult:
    """Allreduce time, algbw and busbw for every size (see :mod:`elastic_trainer.doctor.perf`)."""
    rows = perf.measure_bandwidth(
        setup.sizes,
        iters=setup.iters,
        warmup=setup.warmup,
        device=setup.device,
        world_size=setup.world_size,
    )
    small, large = rows[0], rows[-1]
    detail = (
        f"{len(rows)} size{'s' if len(rows) > 1 else ''}: latency {small.time_us:.1f} us at {format_size(small.size_bytes)}, "
        f"{large.time_us:.1f} us at {format_size(large.size_bytes)}"
    )
    if setup.world_size > 1:
        detail += f" (busbw {large.busbw_gbps:.3f} GB/s)"
    else:
        detail += " (one rank: nothing crosses a link, busbw is 0)"
    data = {
        "rows": [asdict(row) for row in rows],
        "iters": setup.iters,
        "warmup": setup.warmup,
        "world_size": setup.world_size,
    }
    return CheckResult(name="bandwidth", status=PASS, detail=detail, data=data)


def check_compute_comm(setup: Setup) -> CheckResult:
    """Forward+backward time of the example model without DDP (slowest rank) against the time of
    one allreduce of its gradients: how much of a step DDP must hide behind the backward pass."""
    model, batch_size, device = setup.model, setup.batch_size, setup.device
    iters, warmup = setup.iters, setup.warmup
    torch.manual_seed(0)
    module = model.build().to(device).train()
    inputs, target = model.batch(batch_size, seed=30_000 + setup.rank, device=device)

    def step() -> None:
        module.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(module(inputs), target).backward()

    compute = perf.slowest(perf.time_loop(step, iters=iters, warmup=warmup, device=device), device)
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    message = max(perf.ELEMENT_BYTES, -(-grad_bytes // perf.ELEMENT_BYTES) * perf.ELEMENT_BYTES)
    comm = perf.time_allreduce(message, iters=iters, warmup=warmup, device=device)
    ratio = perf.compute_comm_ratio(compute, comm)
    data = {
        "model": model.source,
        "batch_per_rank": batch_size,
        "gradient_bytes": grad_bytes,
        "compute_ms": compute * 1e3,
        "comm_ms": comm * 1e3,
        "ratio": ratio,
    }
    detail = (
        f"{model.source}, batch {batch_size}/rank, {format_size(grad_bytes)} of gradients: forward+backward "
        f"{compute * 1e3:.2f} ms, their allreduce {comm * 1e3:.3f} ms -> compute/comm {ratio:.1f}"
    )
    status, verdict = _ratio_verdict(ratio, setup.world_size)
    return CheckResult(name="compute_comm", status=status, data=data, detail=detail + verdict)


def _ratio_verdict(ratio: float, world_size: int) -> tuple[str, str]:
    """The status of a compute/comm ratio and what to add to the check's line about it."""
    if world_size == 1:
        return PASS, " (one rank: no communication across ranks)"
    if ratio < RATIO_WARN_BELOW:
        return WARN, (
            ": communication-bound, DDP cannot hide the allreduce (larger per-rank batches, gradient "
            "accumulation with no_sync, or fewer ranks)"
        )
    if ratio < RATIO_ADVISED:
        return PASS, (
            f" (below the {RATIO_ADVISED:g}:1 the DDP guide aims for: scaling will be sublinear)"
        )
    return PASS, ""


COLLECTIVE_CHECKS: dict[str, Callable[[Setup], CheckResult]] = {
    "allreduce": check_allreduce,
    "grad_sync": check_grad_sync,
    "bandwidth": check_bandwidth,
    "compute_comm": check_compute_comm,
}
"""The checks every rank runs together, in this order, after the process group exists."""
