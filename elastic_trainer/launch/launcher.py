"""``elastic-trainer run``: torchrun's own launcher over ``etcd-v3``, with an embedded etcd.

    elastic-trainer run --nnodes 1:2 --nproc-per-node 2 -m elastic_trainer.examples.synthetic_cnn

The agent, restarts and worker management are torch's (``torch.distributed.run``); this module
chooses defaults, validates everything a user can get wrong before anything starts, starts an
embedded etcd when no endpoint is given, wires in the node's metrics, the failure policy, warm
start, the frozen-worker watchdog and the janitor, and always cleans up. Design:
``docs/design/launcher.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import logging
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_trainer.launch.options import RunOptions, UserError, rendezvous_conf
from elastic_trainer.runtime.settings import ENV_LAUNCHER_ID, HealSettings, LaunchContract

if TYPE_CHECKING:
    from elastic_trainer.heal.protocol import Epoch
    from elastic_trainer.launch.failure_policy import Verdict as FailurePolicyVerdict
    from elastic_trainer.launch.in_place import HealCallback
    from elastic_trainer.launch.janitor import Janitor
    from elastic_trainer.launch.node_metrics import LauncherMetrics
    from elastic_trainer.launch.progress_publisher import ProgressPublisher
    from elastic_trainer.launch.warm_start import WarmStartServer
    from rendezvous.settings import RendezvousSettings

log = logging.getLogger(__name__)


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
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_argv(
    options: RunOptions,
    endpoint: str,
    run_id: str,
    nproc: int,
    target: Target,
    worker_args: Sequence[str] | None = None,
    *,
    in_place_backend: bool = False,
) -> list[str]:
    """The torchrun command line this launch is equivalent to (``worker_args`` replaces the
    target's own arguments when workers go through the warm-start client). ``in_place_backend``:
    the launcher's own command line, whose backend is ``etcd-v3`` wrapped by
    :mod:`elastic_trainer.launch.in_place` (registered in this process only)."""
    backend = "etcd-v3"
    if in_place_backend:
        from elastic_trainer.launch.in_place import BACKEND_NAME

        backend = BACKEND_NAME
    argv = [
        f"--nnodes={options.nnodes}",
        f"--nproc-per-node={nproc}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={rendezvous_conf(options)}",
        f"--max-restarts={options.max_restarts}",
        f"--monitor-interval={options.monitor_interval}",
    ]
    if options.log_dir:
        argv += [f"--log-dir={options.log_dir}", "--tee=3"]
    return argv + (list(worker_args) if worker_args is not None else target.torchrun_args())


def rendezvous_settings(options: RunOptions, run_id: str) -> RendezvousSettings:
    """The rendezvous settings this launch gives torchrun, parsed by the handler's own parser.

    Raises:
        UserError: an unknown key or a bad value (the handler's one-line message).
    """
    from rendezvous.settings import RendezvousConfigError, settings_from_conf

    try:
        return settings_from_conf(
            rendezvous_conf(options), endpoint=options.rdzv_endpoint or "", run_id=run_id or "check"
        )
    except RendezvousConfigError as exc:
        raise UserError(str(exc)) from exc


def _check_etcd(settings: RendezvousSettings | None, endpoint: str) -> None:
    """Reach etcd with one ``Status`` request (``settings`` None: the embedded etcd at ``endpoint``)
    and warn in one line when its version is older than the one without known faults."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from rendezvous.etcd_client import (
        EtcdClientConfig,
        EtcdConnection,
        parse_endpoints,
        quiet_retries,
    )
    from rendezvous.etcd_version import status_version, version_warning
    from rendezvous.settings import RendezvousConfigError

    try:
        config = (
            settings.client_config()
            if settings
            else EtcdClientConfig(endpoints=parse_endpoints(endpoint))
        )
        connection = EtcdConnection(config)
    except (RendezvousConfigError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    try:
        with quiet_retries():  # a user mistake is one line, not a line per retry
            version = connection.call(lambda client: status_version(client, config.read_timeout),
                                      what="a status request", read=True)  # fmt: skip
    except RendezvousConnectionError as exc:
        raise UserError(f"cannot use etcd: {exc}") from exc
    finally:
        connection.close()
    warning = version_warning(version, endpoint, embedded=settings is None)
    if warning:
        log.warning("%s", warning)


EMBEDDED_LAST_CALL_S = 0.1
"""The first round's last call on this node's own embedded etcd (unless ``--last-call-timeout`` is
given): no other node can be there yet (it needs the endpoint this node prints once its etcd is
up), so waiting for one only delays the first step (5 s, issue 30); a later node joins in place.
The rendezvous settings want a positive value: 0.1 s."""


def for_embedded_etcd(options: RunOptions) -> RunOptions:
    """``options`` as a launch on its own embedded etcd runs them (see :data:`EMBEDDED_LAST_CALL_S`)."""
    if (
        options.rdzv_endpoint is not None
        or options.sources.get("last_call_timeout", "default") != "default"
    ):
        return options
    return dataclasses.replace(options, last_call_timeout=EMBEDDED_LAST_CALL_S)


def launch(options: RunOptions, target: Target, *, dry_run: bool = False) -> int:
    """Run the job; return the process exit code.

    Raises:
        UserError: anything the user can fix, detected before workers start.
    """
    try:
        return _launch_and_clean_up(options, target, dry_run=dry_run)
    except LauncherSignal as exc:
        # Everything started so far was stopped on the way out (the ExitStacks; the janitor
        # covers what a second signal interrupted): one line, the signal's exit status.
        log.warning(
            "stopped by %s while starting; what it had started is cleaned up", exc.sigval.name
        )
        return 128 + int(exc.sigval)


def _launch_and_clean_up(options: RunOptions, target: Target, *, dry_run: bool) -> int:
    target.check()
    options = for_embedded_etcd(options)
    with contextlib.ExitStack() as cleanup:
        janitor = None
        if not dry_run:
            from elastic_trainer.launch.janitor import Janitor, sweep_stale

            janitor = (
                Janitor()
            )  # first in, last out: cleans up even after a SIGKILL of this process
            cleanup.callback(janitor.close)
            for path in sweep_stale():  # what launchers killed with their janitor left
                log.info("removed %s (its launcher is gone)", path)
            # Workers (cold or warm-forked) inherit this marker: none outlives this launcher either.
            launcher_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
            tell_workers(LaunchContract(launcher_id=launcher_id))
            janitor.stop_processes_with_env(ENV_LAUNCHER_ID, launcher_id)
        warm = None
        if options.warm_start == "on" and not dry_run:
            # First of all: the server's imports then overlap the launcher's own and the
            # rendezvous, so even a node's first workers (a join) do not wait for them in series.
            from elastic_trainer.launch.warm_start import DEFAULT_PRELOAD, start_server

            extra = [name for name in options.warm_preload.split(",") if name]
            warm = start_server([*DEFAULT_PRELOAD, *extra])
            cleanup.callback(warm.close)
        return _launch(options, target, warm, janitor, dry_run=dry_run)


def _launch(
    options: RunOptions,
    target: Target,
    warm: WarmStartServer | None,
    janitor: Janitor | None,
    *,
    dry_run: bool,
) -> int:
    # Up to the dry run's answer nothing imports torch (seconds on a cold start): a user's
    # mistake or --dry-run is answered in a fraction of a second.
    from rendezvous.etcd_config import parse_endpoints

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
    settings = rendezvous_settings(
        options, options.run_id or "check"
    )  # every key, before anything starts
    if options.metrics_port:
        from elastic_trainer.runtime.failures import ConfigError
        from elastic_trainer.runtime.settings import ENV_METRICS_ALLREDUCE, allreduce_timing_mode

        try:  # before etcd and the agent: a typo fails once, not per worker
            allreduce_timing_mode(os.environ.get(ENV_METRICS_ALLREDUCE))
        except ConfigError as exc:
            raise UserError(str(exc)) from exc
    if dry_run:
        endpoint = options.rdzv_endpoint or f"{options.etcd_host}:<free port>"
        print(
            "torchrun "
            + " ".join(
                torchrun_argv(options, endpoint, options.run_id or "<derived>", nproc, target)
            )
        )
        return 0

    from torch.distributed.run import get_args_parser

    from rendezvous.plugin import ensure_registered

    ensure_registered()
    with contextlib.ExitStack() as cleanup:
        if options.rdzv_endpoint is None:
            from rendezvous.etcd_server import EtcdServer, EtcdServerError

            data_dir = cleanup.enter_context(
                tempfile.TemporaryDirectory(prefix="elastic-trainer-etcd-")
            )
            if janitor is not None:
                janitor.remove_on_exit(data_dir)  # and stops the etcd whose --data-dir is in it
            server = EtcdServer.single(Path(data_dir) / "data", host=options.etcd_host, quiet=True)
            cleanup.callback(server.stop)
            try:
                server.start()
            except EtcdServerError as exc:
                raise UserError(f"embedded etcd: {exc}") from exc
            if janitor is not None and server.pid is not None:
                janitor.stop_on_exit(server.pid)
            endpoint = server.endpoint
            run_id = options.run_id or f"local-{uuid.uuid4().hex[:12]}"
            log.warning("%s", join_banner(endpoint, run_id, options.etcd_host))
            _check_etcd(None, endpoint)
        else:
            endpoint, run_id = options.rdzv_endpoint, options.run_id or ""
            _check_etcd(settings, endpoint)

        publisher = None
        metrics: LauncherMetrics | None = None
        if options.metrics_port:
            from elastic_trainer.launch.node_metrics import (
                LauncherMetricsConfig,
                MetricsError,
                start_launcher_metrics,
            )

            try:
                metrics = start_launcher_metrics(
                    LauncherMetricsConfig(
                        addr=options.metrics_addr, port=options.metrics_port, run_id=run_id
                    )
                )
            except (MetricsError, OSError) as exc:
                raise UserError(
                    metrics_endpoint_error(options.metrics_addr, options.metrics_port, exc)
                ) from exc
            cleanup.callback(metrics.close)
            if janitor is not None and metrics.owns_directory:
                janitor.remove_on_exit(
                    metrics.multiproc_dir
                )  # the workers' files, after a SIGKILL too
            log.warning("node metrics on %s", metrics.url)
            publisher = _start_progress_publisher(options, endpoint, run_id, metrics)
            cleanup.callback(publisher.close)  # runs before metrics.close and before etcd stops
        _watch_frozen_workers(cleanup, options, janitor, metrics)

        # Workers run the target through worker_entry, which records failures for the policy.
        worker_args = [*WORKER_ENTRY, *target.torchrun_args()]
        if warm is not None:
            worker_args = warm.client_args(
                target.torchrun_args()
            )  # falls back to worker_entry, cold
            warm.wait_ready()  # join only once our workers can start at once (see wait_ready)
        verdicts = _watch_failures(cleanup, publisher)
        _claim_job_identity(cleanup, options, target)
        if options.heal == "in_place":
            _heal_in_place(
                options,
                endpoint,
                nproc,
                node=metrics.node if metrics is not None else None,
                on_heal=_report_heals(warm, metrics, publisher),
            )
            from elastic_trainer.launch.in_place import leave_all
            from elastic_trainer.runtime.torch_compat import without_exit_barrier

            cleanup.callback(
                leave_all
            )  # before etcd stops: a SIGTERM ends run() without a shutdown
            cleanup.callback(without_exit_barrier())
            _replace_killed_workers(cleanup, warm)
        args = get_args_parser().parse_args(
            torchrun_argv(
                options,
                endpoint,
                run_id,
                nproc,
                target,
                worker_args,
                in_place_backend=options.heal == "in_place",
            )
        )
        code = 1
        try:
            code = _run_agent(args, options, run_id, verdicts, publisher)
            return code
        finally:
            # The workers are gone: whatever hangs in the clean-up or at exit, the launcher ends.
            from elastic_trainer.launch.exit_deadline import ExitDeadline

            ExitDeadline().arm(code)


def _run_agent(
    args: Any,
    options: RunOptions,
    run_id: str,
    verdicts: list[FailurePolicyVerdict],
    publisher: ProgressPublisher | None,
) -> int:
    """Run torchrun's agent until the job ends; the launcher's exit status, the outcome logged."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError
    from torch.distributed.run import run

    install_sigterm_as_exception(agent=True)
    try:
        run(args)
    except ChildFailedError as exc:
        if not verdicts:
            rank, failure = exc.get_first_failure()
            log.error("job failed: worker rank %s exited with %s", rank, failure.exitcode)
            if publisher is not None:
                publisher.publish_error(f"worker rank {rank} exited with {failure.exitcode}")
            return 1
        verdict = verdicts[-1]
        if verdict.traceback:
            sys.stderr.write(verdict.traceback)
        log.error(
            "job failed: %s",
            verdict.reason
            if not verdict.restart
            else f"{verdict.reason}; no restarts left (--max-restarts {options.max_restarts})",
        )
        return verdict.exit_code
    except SignalException as exc:
        log.warning("stopped by %s; workers were given their checkpoint grace", exc.sigval.name)
        return 128 + int(exc.sigval)
    except RendezvousClosedError:
        # torch closes a run when any node's agent ends (the job finished, or a node gave up):
        # a node that comes back later has nothing to join. Not a success: this node did no work.
        log.error(
            "run %r is closed (the job finished or a node gave up before this node could rejoin); "
            "nothing left to join",
            run_id,
        )
        return 1
    except RendezvousError as exc:  # join timeout, etcd gone for longer than retry_timeout
        log.error("rendezvous of run %r failed: %s", run_id, exc)
        return 1
    return 0


def _replace_killed_workers(cleanup: contextlib.ExitStack, warm: WarmStartServer | None) -> None:
    """A worker's process tree is one unit: when the agent's own child (a warm-start client, or a
    cold worker) dies of a signal while the job heals in place, start a replacement that joins its
    peers, as the client does when its worker dies, instead of letting the agent restart the
    node's whole group (its live workers would lose their state). A signal the agent sends while
    it stops its workers is marked (the warm server's stopping file), so it ends them for good."""
    import collections

    from elastic_trainer.launch.in_place import job_heals_now
    from elastic_trainer.launch.warm_start import MAX_REPLACEMENTS, record_death
    from elastic_trainer.runtime.settings import ENV_HEAL_JOIN
    from elastic_trainer.runtime.torch_compat import around_worker_stops, replace_failed_workers

    replaced: collections.Counter[int] = collections.Counter()

    def decide(local_rank: int, pid: int, code: int) -> dict[str, str] | None:
        if code >= 0 or replaced[local_rank] >= MAX_REPLACEMENTS or not job_heals_now():
            return None
        replaced[local_rank] += 1
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        death = f"local worker {local_rank} (pid {pid}) died of {name}"
        log.warning("%s; starting a replacement that joins its peers in place", death)
        if warm is not None:
            record_death(warm.directory, death)
        return {ENV_HEAL_JOIN: "1"}

    cleanup.callback(replace_failed_workers(decide))
    if warm is not None:
        cleanup.callback(tell_workers(LaunchContract(stopping_file=str(warm.stopping_file))))
        cleanup.callback(around_worker_stops(warm.agent_stopping))


def _heal_in_place(
    options: RunOptions,
    endpoint: str,
    nproc: int,
    *,
    node: str | None,
    on_heal: HealCallback | None = None,
) -> None:
    """Register the in-place rendezvous backend and tell the workers how to heal."""
    from elastic_trainer.launch.in_place import register_backend
    from elastic_trainer.metrics.node_name import local_node_name

    node = node or local_node_name()
    register_backend(node=node, on_heal=on_heal)
    heal = HealSettings(
        enabled=True,
        join=False,
        endpoint=endpoint,
        rdzv_conf=rendezvous_conf(options),
        world=(options.min_nodes * nproc, options.max_nodes * nproc),
    )
    tell_workers(LaunchContract(node=node, heal=heal))


def metrics_endpoint_error(addr: str, port: int, exc: BaseException) -> str:
    """The one line for a metrics endpoint that cannot start; a port in use (typically a second
    node on the same host, both on the default port) says what to pass instead."""
    import errno

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
    import socket

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


WORKER_ENTRY = ("-m", "elastic_trainer.train.worker_entry")
"""How torchrun starts a cold worker: the target under the worker entry point."""


def _start_progress_publisher(
    options: RunOptions, endpoint: str, run_id: str, metrics: LauncherMetrics
) -> ProgressPublisher:
    """Publish the job's progress to etcd for ``elastic-trainer status`` (while this node hosts
    global rank 0; see elastic_trainer.launch.progress_publisher)."""
    from elastic_trainer.launch.progress_publisher import ProgressPublisher
    from rendezvous.settings import RendezvousConfigError, settings_from_conf

    try:
        settings = settings_from_conf(rendezvous_conf(options), endpoint=endpoint, run_id=run_id)
        publisher = ProgressPublisher.from_settings(
            settings, metrics, interval_s=options.progress_interval
        )
    except (RendezvousConfigError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    publisher.start()
    return publisher


def _watch_frozen_workers(
    cleanup: contextlib.ExitStack,
    options: RunOptions,
    janitor: Janitor | None,
    metrics: LauncherMetrics | None,
) -> None:
    """Give the workers a heartbeat directory and stop any that freezes (``--frozen-timeout``, 0:
    off; see elastic_trainer.launch.watchdog). Stops before the directory goes."""
    if not options.frozen_timeout:
        return
    from elastic_trainer.launch.watchdog import FrozenWorkerWatchdog, WatchdogConfig
    from elastic_trainer.metrics.node_name import local_node_name

    directory = cleanup.enter_context(
        tempfile.TemporaryDirectory(prefix="elastic-trainer-heartbeat-", ignore_cleanup_errors=True)
    )
    if janitor is not None:
        janitor.remove_on_exit(directory)
    config = WatchdogConfig(
        directory=Path(directory),
        node=metrics.node if metrics else local_node_name(),
        floor_s=options.frozen_timeout,
    )
    watchdog = FrozenWorkerWatchdog(
        config, on_frozen=metrics.frozen_workers.stopped if metrics else None
    )
    cleanup.callback(tell_workers(LaunchContract(heartbeat_dir=directory)))
    watchdog.start()
    cleanup.callback(watchdog.stop)


def _report_heals(
    warm: WarmStartServer | None,
    metrics: LauncherMetrics | None,
    publisher: ProgressPublisher | None,
) -> HealCallback:
    """What the launcher does when its job healed in place: count it (``elastic_trainer_heals_total``)
    and, if this node knows the root cause (a worker of its own that died, a member node it saw
    lost), log it and report it as the run's last error (``status``)."""
    from elastic_trainer.launch.in_place import describe_heal
    from elastic_trainer.launch.warm_start import take_deaths

    def on_heal(epoch: Epoch, lost_nodes: Sequence[str]) -> None:
        if metrics is not None:
            metrics.agent_metrics.healed(
                nodes=len({member.slot.rsplit("/", 1)[0] for member in epoch.members})
            )
        causes = [*(take_deaths(warm.directory) if warm is not None else []), *lost_nodes]
        line = describe_heal(epoch, causes)
        log.warning("%s", line)
        if causes and publisher is not None:
            publisher.publish_error(line)

    return on_heal


def _watch_failures(
    cleanup: contextlib.ExitStack, publisher: ProgressPublisher | None = None
) -> list[FailurePolicyVerdict]:
    """Install the failure policy on torchrun's agent; returns the list its verdicts go to."""
    from elastic_trainer.launch.failure_policy import FailurePolicy
    from elastic_trainer.runtime.torch_compat import on_group_failure

    policy = FailurePolicy()
    verdicts: list[FailurePolicyVerdict] = []

    def decide(failures: dict[int, Any], remaining: int) -> bool:
        if not failures:
            return True  # unhealthy without a failed worker: torch's own handling
        verdict = policy.judge(failures)
        verdicts.append(verdict)
        if publisher is not None:
            publisher.publish_error(verdict.reason)  # one line: status shows it as the last error
        if verdict.restart and remaining > 0:
            log.warning(
                "%s; restarting the worker group (%d restart(s) left)",
                verdict.reason,
                remaining - 1,
            )
        return verdict.restart

    cleanup.callback(on_group_failure(decide))
    return verdicts


def _claim_job_identity(cleanup: contextlib.ExitStack, options: RunOptions, target: Target) -> None:
    """Tell the rendezvous what this job runs (the real target, also when workers start through
    the warm-start client): a node of another job under the same run id is refused."""
    from rendezvous.job_identity import JobIdentity, set_job_identity

    entry = target.module if target.module is not None else target.script
    set_job_identity(
        JobIdentity.create(
            entry or "", target.args, module=target.module is not None, nnodes=options.nnodes
        )
    )
    cleanup.callback(set_job_identity, None)


class LauncherSignal(BaseException):
    """SIGTERM/SIGINT while the launcher starts, before torch's agent runs: a ``BaseException``,
    so that no ``except Exception`` on the way (a retry, an error translation) takes it for a
    failure; :func:`launch` turns it into one line and the exit status ``128 + signal``."""

    def __init__(self, sigval: signal.Signals) -> None:
        super().__init__(f"launcher got {sigval.name}")
        self.sigval = sigval


def install_sigterm_as_exception(*, agent: bool = False) -> None:
    """Make SIGTERM/SIGINT unwind the launcher (so ``finally`` blocks stop etcd) before torch
    installs its own handlers for its workers' lifetime.

    Up to the agent (``agent`` False) a signal raises :class:`LauncherSignal`, which needs no
    torch import (a signal may come in the middle of importing it). Once the agent runs
    (``agent`` True) it raises torch's ``SignalException``, which torch's agent handles: it
    stops its workers and, unlike for any other error, leaves the rendezvous open for the
    job's other nodes."""
    if agent:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        def raise_signal(signum: int, _frame: object) -> None:
            raise SignalException(f"launcher got signal {signum}", sigval=signal.Signals(signum))
    else:

        def raise_signal(signum: int, _frame: object) -> None:
            raise LauncherSignal(signal.Signals(signum))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, raise_signal)


def split_target(words: Sequence[str], *, as_module: bool) -> Target:
    """Build the target from argparse's remainder (first word: the script or module)."""
    if not words:
        raise UserError("nothing to run: give SCRIPT or -m MODULE")
    if as_module:
        return Target(None, words[0], tuple(words[1:]))
    return Target(words[0], None, tuple(words[1:]))


def tell_workers(contract: LaunchContract) -> Callable[[], None]:
    """Write ``contract``'s set fields into this process's environment, which every worker (cold
    or warm-forked) inherits; return what takes them back out."""
    written = contract.to_environ()
    os.environ.update(written)

    def take_back() -> None:
        for name in written:
            os.environ.pop(name, None)

    return take_back


def default_env_for_workers() -> None:
    """Environment defaults the workers inherit (never overriding the user's)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tell_workers(
        LaunchContract(reports_failures=True)
    )  # this launcher prints root causes: workers say one line
