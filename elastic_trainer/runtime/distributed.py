"""Process-group setup and teardown for workers started by torchrun (or by hand, single process).

Reads ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` (a legacy ``--local-rank`` argument too), picks
``cuda:LOCAL_RANK`` and NCCL when CUDA is present, the CPU and gloo otherwise, and creates the group
with a generous timeout (30 minutes by default) so a slow rank is tolerated. Before the group
exists the NCCL environment is made consistent with that timeout (values the user set are kept):
asynchronous error handling on, so a failed or timed-out collective ends the process and torchrun
restarts the group instead of hanging; blocking wait off (the two modes exclude each other); the
watchdog monitor on, its heartbeat timeout equal to the collective timeout (it never ends a
process sooner than a stuck collective would). Under one torchrun agent that serves the same
store to every restart (``--standalone``), the group's keys are kept apart per attempt.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.runtime.settings import env_int
from rendezvous.plugin import WORKER_ENV_BACKEND

log = logging.getLogger(__name__)

NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"
NCCL_ENABLE_MONITORING = "TORCH_NCCL_ENABLE_MONITORING"
NCCL_HEARTBEAT_TIMEOUT_SEC = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"


@dataclass(frozen=True, slots=True)
class DistEnv:
    """Where this worker sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    restart_count: int
    """``TORCHELASTIC_RESTART_COUNT``: how often this node's agent restarted the workers."""
    launched: bool
    """Started by a launcher (torchrun); ``False``: a single process run by hand."""
    device: torch.device
    backend: str

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def strip_local_rank_arg(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """Remove a legacy ``--local_rank N`` / ``--local-rank=N`` from ``argv``.

    ``torch.distributed.launch`` without ``--use-env`` passes it; torchrun sets ``LOCAL_RANK``.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None)
    try:
        known, rest = parser.parse_known_args(list(argv))
    except SystemExit:
        raise ConfigError("--local-rank: expects an integer") from None
    return known.local_rank, rest


def read_env(
    *,
    local_rank_arg: int | None = None,
    backend: str | None = None,
    environ: MutableMapping[str, str] | None = None,
    cuda_devices: int | None = None,
) -> DistEnv:
    """Read the launcher's environment.

    Args:
        local_rank_arg: value of a legacy ``--local-rank`` argument (``LOCAL_RANK`` wins).
        backend: ``"nccl"`` or ``"gloo"``; default NCCL with CUDA, gloo without.
        environ: defaults to ``os.environ``.
        cuda_devices: visible CUDA devices; defaults to ``torch.cuda.device_count()``.

    Raises:
        ValueError: inconsistent or malformed variables, or LOCAL_RANK without a matching GPU.
    """
    environ = os.environ if environ is None else environ
    cuda_devices = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    rank, world_size, local_rank, launched = _place(environ, local_rank_arg)
    backend, device = _device(backend, local_rank, cuda_devices)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=env_int(environ, "LOCAL_WORLD_SIZE") or 1,
        restart_count=env_int(environ, "TORCHELASTIC_RESTART_COUNT") or 0,
        launched=launched,
        device=device,
        backend=backend,
    )


def _place(
    environ: MutableMapping[str, str], local_rank_arg: int | None
) -> tuple[int, int, int, bool]:
    """``(rank, world size, local rank, launched)`` from torchrun's variables (see :func:`read_env`)."""
    rank, world_size = env_int(environ, "RANK"), env_int(environ, "WORLD_SIZE")
    local_rank = env_int(environ, "LOCAL_RANK")
    if local_rank is not None and local_rank_arg is not None and local_rank != local_rank_arg:
        log.warning(
            "LOCAL_RANK=%d and --local-rank=%d disagree; using LOCAL_RANK",
            local_rank,
            local_rank_arg,
        )
    if local_rank is None:
        local_rank = local_rank_arg
    launched = rank is not None or world_size is not None
    if launched and (rank is None or world_size is None):
        raise ConfigError("RANK and WORLD_SIZE must both be set (start workers with torchrun)")
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    local_rank = 0 if local_rank is None else local_rank
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} is not within WORLD_SIZE={world_size}")
    if local_rank < 0:
        raise ConfigError(f"LOCAL_RANK: must be >= 0, got {local_rank}")
    return rank, world_size, local_rank, launched


def _device(backend: str | None, local_rank: int, cuda_devices: int) -> tuple[str, torch.device]:
    """The backend and this worker's device: ``cuda:LOCAL_RANK`` and NCCL where CUDA is, the CPU
    and gloo otherwise (an explicit ``backend`` is checked against them)."""
    if backend not in (None, "nccl", "gloo"):
        raise ConfigError(f"backend: must be 'nccl' or 'gloo', got {backend!r}")
    if backend is None:
        backend = "nccl" if cuda_devices > 0 else "gloo"
    if cuda_devices > 0:
        if local_rank >= cuda_devices:
            raise ConfigError(
                f"LOCAL_RANK={local_rank} but only {cuda_devices} CUDA device(s) are visible: start at most "
                f"{cuda_devices} workers per node (--nproc-per-node) or fix CUDA_VISIBLE_DEVICES"
            )
        return backend, torch.device("cuda", local_rank)
    if backend == "nccl":
        raise ConfigError("backend: 'nccl' needs CUDA devices; none are visible (use gloo on CPU)")
    return backend, torch.device("cpu")


def configure_nccl_environment(
    pg_timeout_s: float, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Set NCCL watchdog / error-handling variables consistent with ``pg_timeout_s``.

    Only fills in what the user left unset; warns about user settings that defeat the goal
    (a dead rank must end in a process exit, not a hang). Returns what was set.
    """
    environ = os.environ if environ is None else environ
    wanted = {
        NCCL_ASYNC_ERROR_HANDLING: "1",
        NCCL_ENABLE_MONITORING: "1",
        NCCL_HEARTBEAT_TIMEOUT_SEC: str(math.ceil(pg_timeout_s)),
    }
    applied = {}
    for name, value in wanted.items():
        if name not in environ:
            environ[name] = value
            applied[name] = value
    if (
        environ.get(NCCL_ASYNC_ERROR_HANDLING) == "0"
        and environ.get(NCCL_BLOCKING_WAIT, "0") == "0"
    ):
        log.warning(
            "%s=0 without %s: a failed or timed-out NCCL collective leaves the process hanging "
            "instead of exiting, so torchrun cannot restart the job",
            NCCL_ASYNC_ERROR_HANDLING,
            NCCL_BLOCKING_WAIT,
        )
    return applied


def init_process_group(env: DistEnv, *, pg_timeout_s: float) -> None:
    """Create the default process group for ``env`` (device selected first, as NCCL requires)."""
    configure_nccl_environment(pg_timeout_s)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    timeout = timedelta(seconds=pg_timeout_s)
    if env.launched:
        dist.init_process_group(
            backend=env.backend,
            timeout=timeout,
            rank=env.rank,
            world_size=env.world_size,
            store=attempt_store(env, timeout),
        )
    else:
        # One process started by hand: no launcher, no MASTER_ADDR; an in-process store suffices.
        dist.init_process_group(
            backend=env.backend, timeout=timeout, store=dist.HashStore(), rank=0, world_size=1
        )
    announce_group(env, pg_timeout_s)


def attempt_store(
    env: DistEnv, timeout: timedelta, environ: MutableMapping[str, str] | None = None
) -> dist.Store | None:
    """The store for this attempt's group when one torchrun agent shares its rendezvous store with
    its workers (``--standalone``, or one node on c10d or static), keyed by the attempt and by the
    groups this process formed before in it; ``None`` elsewhere (torch's own ``env://`` store).

    torch 2.13's c10d and static rendezvous serve one TCP store to every round, and a restarted
    group's ranks can read the addresses the last attempt's ranks left there: gloo's full mesh is
    refused, or waits out the collective timeout (``docs/design/launcher.md``, "One store for
    every restart"). One agent gives every worker the same restart count, which names the attempt;
    with several agents the counts differ. A round that torchrun opens for a membership change
    keeps the count: on one node that needs a node that began to join and left before the round
    closed, and is not covered.
    """
    environ = os.environ if environ is None else environ
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if environ.get("GROUP_WORLD_SIZE") != "1":
        restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "")
        if env.rank == 0 and WORKER_ENV_BACKEND not in environ and restarts != "0":
            log.warning(
                "torchrun's agents share one store across the restarts of a job on several "
                "nodes (the c10d and static rendezvous, torch 2.13), and a restarted group can "
                "wait in init_process_group for up to the collective timeout (%.0f s): launch "
                "with --rdzv-backend=etcd-v3 (with c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                "for every agent also helps)",
                timeout.total_seconds(),
            )
        return None
    server = dist.TCPStore(
        environ["MASTER_ADDR"],
        int(environ["MASTER_PORT"]),
        env.world_size,
        is_master=False,
        timeout=timeout,
    )
    formed = _groups_formed.setdefault(env.restart_count, 0)
    _groups_formed[env.restart_count] = formed + 1
    prefix = f"elastic-trainer/attempt-{env.restart_count}/group-{formed}/default_pg"
    return dist.PrefixStore(prefix, server)


_groups_formed: dict[int, int] = {}
"""Default groups this process formed on an attempt's shared store, per restart count: a second
one (a second ``fit``) must not read the first one's keys; every process forms them in order."""


def announce_group(env: DistEnv, pg_timeout_s: float) -> None:
    """The log line that says where this worker sits (whoever created its group), with its pid:
    an operator who kills a worker by hand learns which rank it is."""
    log.info(
        "rank %d/%d (local %d, pid %d) on %s, backend %s, collective timeout %.0f s",
        env.rank,
        env.world_size,
        env.local_rank,
        os.getpid(),
        env.device,
        env.backend,
        pg_timeout_s,
    )


def destroy_process_group() -> None:
    """Destroy the default process group if one exists; never raises (it runs on error paths)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - cleanup after a failure must not mask the failure
        log.warning("destroy_process_group failed", exc_info=True)
