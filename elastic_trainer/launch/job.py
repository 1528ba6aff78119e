"""Start the job a :class:`~elastic_trainer.launch.plan.LaunchPlan` describes and run torch's agent.

:func:`elastic_trainer.launch.launcher.launch` imports this module only once the plan is checked
and the job really starts: it imports torch and torchrun (seconds on a cold start). In order: the
embedded etcd (or the given one, checked), the node's metrics and progress publisher, the
frozen-worker watchdog, the failure policy, the job's identity, in-place healing, then torchrun's
agent until the job ends. Everything started is stopped on the way out (one ``ExitStack``).
Design: ``docs/design/launcher.md``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
)
from torch.distributed.run import get_args_parser, run

from elastic_trainer.heal.protocol import Epoch
from elastic_trainer.launch.exit_deadline import ExitDeadline
from elastic_trainer.launch.failure_policy import FailurePolicy, Verdict
from elastic_trainer.launch.in_place import (
    BACKEND_NAME,
    HealCallback,
    describe_heal,
    job_heals_now,
    leave_all,
    register_backend,
)
from elastic_trainer.launch.janitor import Janitor
from elastic_trainer.launch.node_metrics import (
    LauncherMetrics,
    LauncherMetricsConfig,
    MetricsError,
    start_launcher_metrics,
)
from elastic_trainer.launch.options import RunOptions, UserError
from elastic_trainer.launch.plan import (
    WORKER_ENTRY,
    LaunchPlan,
    Target,
    join_banner,
    metrics_endpoint_error,
    tell_workers,
    torchrun_argv,
)
from elastic_trainer.launch.progress_publisher import ProgressPublisher
from elastic_trainer.launch.warm_start import (
    MAX_REPLACEMENTS,
    WarmStartServer,
    record_death,
    take_deaths,
)
from elastic_trainer.launch.watchdog import FrozenWorkerWatchdog, WatchdogConfig
from elastic_trainer.metrics.node_name import local_node_name
from elastic_trainer.runtime.settings import ENV_HEAL_JOIN, HealSettings, LaunchContract
from elastic_trainer.runtime.torch_compat import (
    around_worker_stops,
    on_group_failure,
    replace_failed_workers,
    without_exit_barrier,
)
from elastic_trainer.train.diagnostics import start_launcher_endpoint, stop_endpoint
from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, quiet_retries
from rendezvous.etcd_server import EtcdServer, EtcdServerError
from rendezvous.etcd_version import status_version, version_warning
from rendezvous.job_identity import JobIdentity, set_job_identity
from rendezvous.plugin import ensure_registered
from rendezvous.settings import RendezvousConfigError, RendezvousSettings

log = logging.getLogger(__name__)


def run_job(plan: LaunchPlan, warm: WarmStartServer | None, janitor: Janitor | None) -> int:
    """Start the job's parts, run torchrun's agent until the job ends; the exit status."""
    options = plan.options
    ensure_registered()
    with contextlib.ExitStack() as cleanup:
        endpoint, rendezvous = _start_etcd(cleanup, plan, janitor)
        metrics = publisher = None
        if options.metrics_port:
            metrics = _start_metrics(cleanup, options, rendezvous.run_id, endpoint, janitor)
            publisher = _start_progress_publisher(options, rendezvous, metrics)
            cleanup.callback(publisher.close)  # runs before metrics.close and before etcd stops
        _watch_frozen_workers(cleanup, options, janitor, metrics)
        node = metrics.node if metrics is not None else local_node_name()
        _serve_diagnostics(cleanup, rendezvous, node)
        worker_args = _worker_args(plan.target, warm)
        verdicts = _watch_failures(cleanup, publisher)
        _claim_job_identity(cleanup, options, plan.target)
        backend = "etcd-v3"
        if options.heal == "in_place":
            reports = _report_heals(warm, metrics, publisher, verdicts)
            _heal_in_place(cleanup, plan, endpoint, node, reports)
            _replace_killed_workers(cleanup, warm)
            backend = BACKEND_NAME
        argv = torchrun_argv(plan, endpoint, rendezvous.run_id, worker_args, backend=backend)
        args = get_args_parser().parse_args(argv)
        code = 1
        try:
            code = _run_agent(args, options, rendezvous.run_id, verdicts, publisher)
            return code
        finally:
            # The workers are gone: whatever hangs in the clean-up or at exit, the launcher ends.
            ExitDeadline().arm(code)


def _start_etcd(
    cleanup: contextlib.ExitStack, plan: LaunchPlan, janitor: Janitor | None
) -> tuple[str, RendezvousSettings]:
    """The job's etcd: this node's embedded one (``--rdzv-endpoint`` not given: started here,
    its join line logged) or the given one; reached once either way. Returns its endpoint and
    the plan's rendezvous settings for it and the job's run id."""
    options = plan.options
    if options.rdzv_endpoint is not None:
        endpoint, run_id = options.rdzv_endpoint, options.run_id or ""
        rendezvous = _settings_at(plan.rendezvous, endpoint, run_id)
        _check_etcd(rendezvous.client_config(), endpoint, embedded=False)
        return endpoint, rendezvous
    data_dir = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="elastic-trainer-etcd-"))
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
    rendezvous = _settings_at(plan.rendezvous, endpoint, run_id)
    _check_etcd(EtcdClientConfig(endpoints=rendezvous.endpoints), endpoint, embedded=True)
    return endpoint, rendezvous


def _settings_at(settings: RendezvousSettings, endpoint: str, run_id: str) -> RendezvousSettings:
    try:
        return settings.for_endpoint(endpoint, run_id)
    except RendezvousConfigError as exc:
        raise UserError(str(exc)) from exc


WAITING_LINE_S = 3.0
"""Seconds of silence from etcd at start after which the launcher says it is waiting."""


def _check_etcd(config: EtcdClientConfig, endpoint: str, *, embedded: bool) -> None:
    """Reach etcd with one ``Status`` request and warn in one line when its version is older than
    the one without known faults (the embedded etcd: plain, with the connection's defaults)."""
    try:
        connection = EtcdConnection(config)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    waiting = threading.Timer(
        WAITING_LINE_S,
        lambda: log.warning("waiting for etcd at %s: no answer yet (giving up after %gs)",
                            endpoint, config.retry_timeout),
    )  # fmt: skip
    waiting.daemon = True
    if config.retry_timeout > 2 * WAITING_LINE_S:  # a short budget ends in its one line first
        waiting.start()
    try:
        with quiet_retries():  # a user mistake is one line, not a line per retry
            version = connection.call(lambda client: status_version(client, config.read_timeout),
                                      what="a status request", read=True)  # fmt: skip
    except RendezvousConnectionError as exc:
        raise UserError(f"cannot use etcd: {exc}") from exc
    finally:
        waiting.cancel()
        connection.close()
    warning = version_warning(version, endpoint, embedded=embedded)
    if warning:
        log.warning("%s", warning)


def _start_metrics(
    cleanup: contextlib.ExitStack,
    options: RunOptions,
    run_id: str,
    endpoint: str,
    janitor: Janitor | None,
) -> LauncherMetrics:
    """The node's Prometheus endpoint (``--metrics-port``), stopped on the way out."""
    try:
        metrics = start_launcher_metrics(
            LauncherMetricsConfig(
                addr=options.metrics_addr,
                port=options.metrics_port,
                run_id=run_id,
                rdzv_endpoint=endpoint,
            )
        )
    except (MetricsError, OSError) as exc:
        raise UserError(
            metrics_endpoint_error(options.metrics_addr, options.metrics_port, exc)
        ) from exc
    cleanup.callback(metrics.close)
    if janitor is not None and metrics.owns_directory:
        janitor.remove_on_exit(metrics.multiproc_dir)  # the workers' files, after a SIGKILL too
    log.warning("node metrics on %s", metrics.url)
    return metrics


def _start_progress_publisher(
    options: RunOptions, rendezvous: RendezvousSettings, metrics: LauncherMetrics
) -> ProgressPublisher:
    """Publish the job's progress to etcd for ``elastic-trainer status`` (while this node hosts
    global rank 0; see elastic_trainer.launch.progress_publisher)."""
    try:
        publisher = ProgressPublisher.from_settings(
            rendezvous, metrics, interval_s=options.progress_interval
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    publisher.start()
    return publisher


def _serve_diagnostics(
    cleanup: contextlib.ExitStack, rendezvous: RendezvousSettings, node: str
) -> None:
    """This launcher's own diagnostics endpoint, beside its workers' (``elastic-trainer debug``
    shows its threads' stacks after the ranks'; docs/diagnostics.md)."""
    server = start_launcher_endpoint(rendezvous, node)
    if server is not None:
        cleanup.callback(stop_endpoint, server)


def _worker_args(target: Target, warm: WarmStartServer | None) -> list[str]:
    """What torchrun starts per worker: the target under the worker entry point, which records
    failures for the policy; through the warm-start client when there is a warm server."""
    if warm is None:
        return [*WORKER_ENTRY, *target.torchrun_args()]
    worker_args = warm.client_args(target.torchrun_args())  # falls back to worker_entry, cold
    warm.wait_ready()  # join only once our workers can start at once (see wait_ready)
    return worker_args


def _run_agent(
    args: Any,
    options: RunOptions,
    run_id: str,
    verdicts: list[Verdict],
    publisher: ProgressPublisher | None,
) -> int:
    """Run torchrun's agent until the job ends; the launcher's exit status, the outcome logged."""
    _signals_to_agent()
    try:
        run(args)
    except ChildFailedError as exc:
        return _job_failed(exc, options, verdicts, publisher)
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


def _job_failed(
    exc: ChildFailedError,
    options: RunOptions,
    verdicts: list[Verdict],
    publisher: ProgressPublisher | None,
) -> int:
    """Say why the job failed (the failure policy's last verdict, else the first failed rank)."""
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


def _signals_to_agent() -> None:
    """From now on SIGTERM/SIGINT raise torch's ``SignalException``, which torch's agent handles:
    it stops its workers and, unlike for any other error, leaves the rendezvous open for the
    job's other nodes (up to here: ``launcher.install_sigterm_as_exception``)."""

    def raise_signal(signum: int, _frame: object) -> None:
        raise SignalException(f"launcher got signal {signum}", sigval=signal.Signals(signum))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, raise_signal)


def _replace_killed_workers(cleanup: contextlib.ExitStack, warm: WarmStartServer | None) -> None:
    """A worker's process tree is one unit: when the agent's own child (a warm-start client, or a
    cold worker) dies of a signal while the job heals in place, start a replacement that joins its
    peers, as the client does when its worker dies, instead of letting the agent restart the
    node's whole group (its live workers would lose their state). A signal the agent sends while
    it stops its workers is marked (the warm server's stopping file), so it ends them for good."""
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
    cleanup: contextlib.ExitStack, plan: LaunchPlan, endpoint: str, node: str, on_heal: HealCallback
) -> None:
    """Register the in-place rendezvous backend and tell the workers how to heal (the plan's
    rendezvous settings, as ``--rdzv-conf`` text: they parse it once, in ``heal/healer.py``)."""
    options = plan.options
    register_backend(node=node, on_heal=on_heal)
    heal = HealSettings(
        enabled=True,
        join=False,
        endpoint=endpoint,
        rdzv_conf=plan.rendezvous.conf,
        world=(options.min_nodes * plan.nproc, options.max_nodes * plan.nproc),
    )
    tell_workers(LaunchContract(node=node, heal=heal))
    cleanup.callback(leave_all)  # before etcd stops: a SIGTERM ends run() without a shutdown
    cleanup.callback(without_exit_barrier())


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
    verdicts: Sequence[Verdict] = (),
) -> HealCallback:
    """What the launcher does when its job healed in place: count it (``elastic_trainer_heals_total``)
    and, if this node knows the root cause (a worker of its own that died, a member node it saw
    lost), log it and report it as the run's last error (``status``). A restart verdict of the
    failure policy since the previous epoch means this node's workers restarted into it."""
    judged = [len(verdicts)]

    def on_heal(epoch: Epoch, lost_nodes: Sequence[str]) -> None:
        new, judged[0] = list(verdicts[judged[0] :]), len(verdicts)
        restarted = any(verdict.restart for verdict in new)  # counted as the agent's restart
        if metrics is not None and not restarted:
            metrics.agent_metrics.healed(
                nodes=len({member.slot.rsplit("/", 1)[0] for member in epoch.members})
            )
        causes = [*(take_deaths(warm.directory) if warm is not None else []), *lost_nodes]
        line = describe_heal(epoch, causes, restarted=restarted)
        log.warning("%s", line)
        if causes and publisher is not None:
            publisher.publish_error(line)

    return on_heal


def _watch_failures(
    cleanup: contextlib.ExitStack, publisher: ProgressPublisher | None = None
) -> list[Verdict]:
    """Install the failure policy on torchrun's agent; returns the list its verdicts go to."""
    policy = FailurePolicy()
    verdicts: list[Verdict] = []

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
    # The policy's verdict says each failure once; torch's agent would say it again first.
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(_without_failed_exitcode)
    cleanup.callback(agent_log.removeFilter, _without_failed_exitcode)
    return verdicts


def _without_failed_exitcode(record: logging.LogRecord) -> bool:
    """Drops torch's ``failed (exitcode: N) local_rank: ...`` line (the verdict says it)."""
    return not str(record.msg).startswith("failed (exitcode:")


def _claim_job_identity(cleanup: contextlib.ExitStack, options: RunOptions, target: Target) -> None:
    """Tell the rendezvous what this job runs (the real target, also when workers start through
    the warm-start client): a node of another job under the same run id is refused."""
    entry = target.module if target.module is not None else target.script
    set_job_identity(
        JobIdentity.create(
            entry or "", target.args, module=target.module is not None, nnodes=options.nnodes
        )
    )
    cleanup.callback(set_job_identity, None)
