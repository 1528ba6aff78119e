"""What one ``elastic-trainer run`` launches, decided and checked before anything starts.

    plan = plan_launch(options, target)           # UserError: a mistake, in one line
    print("torchrun", *torchrun_argv(plan, "etcd:2379", "job-1"))

Everything here runs without torch (seconds on a cold start): ``elastic-trainer run --dry-run``
and a user's mistakes are answered in a fraction of a second (``docs/design/startup-and-threads.md``).
The rendezvous settings are parsed here once, into :attr:`LaunchPlan.rendezvous`; every part of
the launch (torchrun's command line, the workers' heal settings, the progress publisher, the etcd
check) takes them from the plan. :mod:`elastic_trainer.launch.job` starts what the plan says.
"""

from __future__ import annotations

import errno
import glob
import importlib.util
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from elastic_trainer.launch.options import RunOptions, UserError, rendezvous_conf
from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.runtime.settings import (
    ENV_METRICS_ALLREDUCE,
    LaunchContract,
    allreduce_timing_mode,
)
from rendezvous.etcd_config import parse_endpoints
from rendezvous.settings import RendezvousConfigError, RendezvousSettings, settings_from_conf

WORKER_ENTRY = ("-m", "elastic_trainer.train.worker_entry")
"""How torchrun starts a cold worker: the target under the worker entry point."""


@dataclass(frozen=True, slots=True)
class Target:
    """What the workers run: a script path or a module, with its arguments."""

    script: str | None
    module: str | None
    args: tuple[str, ...]

    def __post_init__(self) -> None:
        if (self.script is None) == (self.module is None):
            raise UserError("give exactly one of SCRIPT or -m MODULE")

    def check(self) -> None:
        """Raise :class:`UserError` if the script or module does not exist."""
        if self.script is not None:
            if not Path(self.script).is_file():
                raise UserError(f"script {self.script}: no such file")
            return
        try:
            found = importlib.util.find_spec(self.module or "")
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise UserError(f"module {self.module}: not found on the Python path")

    def torchrun_args(self) -> list[str]:
        head = ["-m", self.module] if self.module is not None else [self.script or ""]
        return [*head, *self.args]


def split_target(words: Sequence[str], *, as_module: bool) -> Target:
    """Build the target from argparse's remainder (first word: the script or module)."""
    if not words:
        raise UserError("nothing to run: give SCRIPT or -m MODULE")
    if as_module:
        return Target(None, words[0], tuple(words[1:]))
    return Target(words[0], None, tuple(words[1:]))


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """One launch, checked: what runs, on how many workers, with which rendezvous settings."""

    options: RunOptions
    target: Target
    nproc: int
    """Workers on this node."""
    rendezvous: RendezvousSettings
    """The launch's rendezvous settings, parsed once (:func:`rendezvous_settings`); their
    endpoint and run id are the job's once its etcd is up (``RendezvousSettings.for_endpoint``)."""


def plan_launch(options: RunOptions, target: Target) -> LaunchPlan:
    """Check everything a user can get wrong that is not checked yet, without torch.

    Raises:
        UserError: the first mistake, in one line.
    """
    nproc = resolve_nproc(options, visible_cuda_devices())
    if options.rdzv_endpoint is not None:
        try:
            parse_endpoints(options.rdzv_endpoint)
        except ValueError as exc:
            raise UserError(f"--rdzv-endpoint {options.rdzv_endpoint!r}: {exc}") from exc
        if not options.run_id:
            raise UserError(
                "--run-id is required with --rdzv-endpoint: jobs sharing an etcd must not share an id"
            )
    settings = rendezvous_settings(options, options.run_id or "check")
    if options.metrics_port:
        try:  # before etcd and the agent: a typo fails once, not per worker
            allreduce_timing_mode(os.environ.get(ENV_METRICS_ALLREDUCE))
        except ConfigError as exc:
            raise UserError(str(exc)) from exc
    return LaunchPlan(options=options, target=target, nproc=nproc, rendezvous=settings)


def resolve_nproc(options: RunOptions, cuda_devices: int) -> int:
    """Workers per node from ``--nproc-per-node`` and ``--device``.

    Raises:
        UserError: CUDA requested but absent, or more workers than visible GPUs.
    """
    device = options.device
    if device == "cuda" and cuda_devices == 0:
        raise UserError("--device cuda: no CUDA device is visible")
    use_cuda = device == "cuda" or (device == "auto" and cuda_devices > 0)
    if options.nproc_per_node == "auto":
        return cuda_devices if use_cuda else 1
    nproc = int(options.nproc_per_node)
    if use_cuda and nproc > cuda_devices:
        raise UserError(
            f"--nproc-per-node {nproc}: only {cuda_devices} GPU(s) visible "
            "(CUDA_VISIBLE_DEVICES); one worker per GPU at most"
        )
    return nproc


def visible_cuda_devices() -> int:
    """The CUDA devices torch sees. On Linux without a GPU driver's device files (``/dev/nvidia*``,
    ``/dev/kfd`` for ROCm) torch sees none, and that is answered without importing it."""
    if (
        sys.platform.startswith("linux")
        and not glob.glob("/dev/nvidia*")
        and not os.path.exists("/dev/kfd")
    ):
        return 0
    import torch  # kept inside: torch-free launches (startup-and-threads.md, "Imports kept inside")

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rendezvous_settings(options: RunOptions, run_id: str) -> RendezvousSettings:
    """The rendezvous settings this launch gives torchrun, parsed by the handler's own parser:
    the rendezvous options first, the user's ``--rdzv-conf`` keys last (they win).

    Raises:
        UserError: an unknown key or a bad value (the handler's one-line message).
    """
    try:
        return settings_from_conf(
            rendezvous_conf(options), endpoint=options.rdzv_endpoint or "", run_id=run_id or "check"
        )
    except RendezvousConfigError as exc:
        raise UserError(str(exc)) from exc


def torchrun_argv(
    plan: LaunchPlan,
    endpoint: str,
    run_id: str,
    worker_args: Sequence[str] | None = None,
    *,
    backend: str = "etcd-v3",
) -> list[str]:
    """The torchrun command line this launch is equivalent to (``worker_args`` replaces the
    target's own arguments when workers go through the warm-start client; ``backend``: the
    launcher's own in-place wrapper of ``etcd-v3``, registered in its process only)."""
    options = plan.options
    argv = [
        f"--nnodes={options.nnodes}",
        f"--nproc-per-node={plan.nproc}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={plan.rendezvous.conf}",
        f"--max-restarts={options.max_restarts}",
        f"--monitor-interval={options.monitor_interval}",
    ]
    if options.log_dir:
        argv += [f"--log-dir={options.log_dir}", "--tee=3"]
    return argv + (list(worker_args) if worker_args is not None else plan.target.torchrun_args())


def dry_run_command(plan: LaunchPlan) -> str:
    """What ``--dry-run`` prints: the torchrun command line, the parts known only later named."""
    options = plan.options
    endpoint = options.rdzv_endpoint or f"{options.etcd_host}:<free port>"
    return "torchrun " + " ".join(torchrun_argv(plan, endpoint, options.run_id or "<derived>"))


def metrics_endpoint_error(addr: str, port: int, exc: BaseException) -> str:
    """The one line for a metrics endpoint that cannot start; a port in use (typically a second
    node on the same host, both on the default port) says what to pass instead."""
    cause = exc if isinstance(exc, OSError) else exc.__cause__
    if isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE:
        return (
            f"metrics port {port} on {addr} is in use (another node on this host?): give each "
            f"node on one host its own --metrics-port (e.g. --metrics-port {port + 1}), or "
            "--metrics-port 0 for no metrics endpoint on this node"
        )
    return f"metrics endpoint {addr}:{port}: {exc}"


def host_address() -> str | None:
    """This host's address as other hosts see it (the first non-loopback IPv4 of its name)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return None
    for info in infos:
        address = str(info[4][0])
        if not address.startswith("127."):
            return address
    return None


def join_banner(endpoint: str, run_id: str, etcd_host: str, address: str | None = None) -> str:
    """The start-up line that tells other nodes how to join this node's embedded etcd."""
    join = f"--rdzv-endpoint {endpoint} --run-id {run_id}"
    if not (etcd_host.startswith("127.") or etcd_host in ("localhost", "::1")):
        return f"embedded etcd on {endpoint} (run id {run_id}); other nodes join with: elastic-trainer run {join} ..."
    address = address if address is not None else host_address()
    hint = (
        f"; for other hosts, start this node with --etcd-host {address} and join {address}:PORT"
        if address
        else "; for other hosts, start this node with --etcd-host <an address they reach>"
    )
    return (
        f"embedded etcd on {endpoint} (run id {run_id}), loopback only: nodes on this host join with "
        f"elastic-trainer run {join} ...{hint}"
    )


def tell_workers(contract: LaunchContract) -> Callable[[], None]:
    """Write ``contract``'s set fields into this process's environment, which every worker (cold
    or warm-forked) inherits; return what takes them back out."""
    written = contract.to_environ()
    os.environ.update(written)

    def take_back() -> None:
        for name in written:
            os.environ.pop(name, None)

    return take_back
