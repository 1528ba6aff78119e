"""The node's metrics endpoint, served by the launcher and alive across worker restarts.

:func:`start_launcher_metrics` (before the agent starts) creates the workers' multiprocess
directory and exports ``PROMETHEUS_MULTIPROC_DIR`` and ``ELASTIC_TRAINER_NODE`` to them, routes the
agent's torch elastic metrics and events into :class:`AgentMetrics`, and serves
``http://<addr>:<port>/metrics`` (default ``0.0.0.0:9400``): the workers' files merged, plus the
agent's metrics and the frozen-worker watchdog's counter (:class:`FrozenWorkerMetrics`). Before
each scrape the files of dead workers are retired (``live*`` gauges dropped, the rest folded into
one archive per kind), so counters never go backwards and a scrape reads a bounded number of
files. Design: ``docs/design/metrics.md``.

    handle = start_launcher_metrics(LauncherMetricsConfig(port=9400, run_id=run_id))
    try:
        torch.distributed.run.main(torchrun_args)
    finally:
        handle.close()
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, InfoMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from elastic_trainer.launch.agent_metrics import AgentMetrics, install_agent_hooks
from elastic_trainer.launch.janitor import OwnedDir
from elastic_trainer.metrics import prometheus_compat
from elastic_trainer.metrics.node_name import local_node_name
from elastic_trainer.metrics.worker import MetricsError
from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.runtime.settings import (
    ENV_METRICS,
    ENV_METRICS_ALLREDUCE,
    ENV_MULTIPROC_DIR,
    LaunchContract,
)
from elastic_trainer.runtime.settings import allreduce_timing_mode as settings_mode

log = logging.getLogger(__name__)

DEFAULT_METRICS_ADDR = "0.0.0.0"
"""All interfaces: Prometheus in the cluster scrapes the pod IP."""
DEFAULT_METRICS_PORT = 9400

ARCHIVE_PID = "archive"


def allreduce_timing_mode(environ: Mapping[str, str] | None = None) -> str:
    """``sampled``, ``trace`` or ``off``: how this launcher's workers will time their allreduces
    (``ELASTIC_TRAINER_METRICS_ALLREDUCE``), checked before any worker starts.

    Raises:
        MetricsError: the variable holds something else.
    """
    raw = (os.environ if environ is None else environ).get(ENV_METRICS_ALLREDUCE)
    try:
        return settings_mode(raw)
    except ConfigError as exc:
        raise MetricsError(str(exc)) from exc


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, killed but not reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return os.path.exists(f"/proc/{pid}") if os.path.isdir("/proc") else True


class LiveMultiProcessCollector(Collector):
    """``MultiProcessCollector`` that first retires the files of processes that died.

    Args:
        path: the multiprocess directory.
        is_alive: liveness test of a pid (injectable for tests).
    """

    def __init__(self, path: str, *, is_alive: Callable[[int], bool] = pid_alive) -> None:
        self._path = path
        self._is_alive = is_alive
        self._inner = MultiProcessCollector(None, path=path)
        # Concurrent scrapes would race mark_process_dead's glob-then-remove.
        self._lock = threading.Lock()

    def reap(self) -> list[int]:
        """Retire every dead pid's files (see the module docstring); return those pids."""
        by_pid: dict[int, list[tuple[str, str]]] = {}
        for filename in os.listdir(self._path):
            found = prometheus_compat.pid_file(filename)
            if found is not None:
                by_pid.setdefault(found[1], []).append((found[0], filename))
        dead = sorted(pid for pid in by_pid if not self._is_alive(pid))
        for pid in dead:
            mark_process_dead(pid, self._path)
            for prefix, filename in by_pid[pid]:
                if prefix in prometheus_compat.MERGE:
                    self._archive(prefix, os.path.join(self._path, filename))
            log.debug("retired the metric files of dead worker pid %d", pid)
        return dead

    def _archive(self, prefix: str, dead_file: str) -> None:
        archive = os.path.join(self._path, prometheus_compat.db_file_name(prefix, ARCHIVE_PID))
        merge = prometheus_compat.MERGE[prefix]
        merged: dict[str, prometheus_compat.Value] = {}
        files = [archive, dead_file] if os.path.exists(archive) else [dead_file]
        for path in files:
            for key, value, timestamp in prometheus_compat.read_values(path):
                merged[key] = (
                    merge(merged[key], (value, timestamp)) if key in merged else (value, timestamp)
                )
        # Written aside and renamed: a scrape never sees a half-written archive (it globs *.db).
        staging = archive + ".tmp"
        if os.path.exists(staging):
            os.remove(staging)
        prometheus_compat.write_values(staging, merged.items())
        os.replace(staging, archive)
        os.remove(dead_file)

    def collect(self) -> Iterable[Any]:
        with self._lock:
            self.reap()
            return list(self._inner.collect())

    def collect_families(self, merge: prometheus_compat.FamilyMerge) -> list[Any]:
        """What :meth:`collect` returns for ``merge``'s families only (a fraction of the cost)."""
        with self._lock:
            self.reap()
            return list(merge.merge(glob.glob(os.path.join(self._path, "*.db"))))


class FrozenWorkerMetrics(Collector):
    """``elastic_trainer_frozen_workers_total``: workers of this node the frozen-worker watchdog
    stopped (:mod:`elastic_trainer.launch.watchdog`). Plain Python behind a collector, like the
    agent's metrics: prometheus-client's value classes would write into the workers' directory.

    Args:
        run_id: the job's rendezvous id.
        node: this node's name.
        registry: registered there when given.
    """

    NAME = "elastic_trainer_frozen_workers"

    def __init__(
        self, *, run_id: str, node: str, registry: CollectorRegistry | None = None
    ) -> None:
        self._labels = [run_id, node]
        self._count = 0
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def stopped(self, _worker: object = None) -> None:
        """The watchdog stopped one frozen worker (``_worker``: what its callback passes)."""
        with self._lock:
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def describe(self) -> Iterable[Metric]:
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            self.NAME,
            "Workers of this node that made no progress for longer than the frozen-worker threshold "
            "and were stopped so the job heals.",
            labels=["run_id", "node"],
        )
        with self._lock:
            family.add_metric(self._labels, self._count)
        return [family]


class JobInfo(Collector):
    """``elastic_trainer_job_info``: the job this launcher runs and where its rendezvous is, so
    that a node's metrics URL is enough to reach the job (``elastic-trainer debug --url``)."""

    NAME = "elastic_trainer_job"

    def __init__(self, *, run_id: str, node: str, rdzv_endpoint: str) -> None:
        self._labels = {"run_id": run_id, "node": node, "rdzv_endpoint": rdzv_endpoint}

    def describe(self) -> Iterable[Metric]:
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        family = InfoMetricFamily(self.NAME, "The job of this node and its rendezvous endpoint.")
        family.add_metric([], self._labels)
        return [family]


class FamilyReader:
    """Some families of what a node's endpoint serves, read in-process (``collect()``, as a
    registry's): the progress publisher reads twice a second, and a merge of every histogram of
    every worker was most of the launcher's CPU while training."""

    def __init__(
        self,
        files: LiveMultiProcessCollector,
        collectors: Iterable[Collector],
        families: Iterable[str],
    ) -> None:
        self._files = files
        self._collectors = tuple(collectors)
        self._merge = prometheus_compat.FamilyMerge(families)

    def collect(self) -> list[Any]:
        wanted = self._merge.families
        own = [f for c in self._collectors for f in c.collect() if f.name in wanted]
        return self._files.collect_families(self._merge) + own


class NodeMetricsServer:
    """A running ``/metrics`` endpoint (see :func:`serve_node_metrics`)."""

    def __init__(
        self,
        httpd: Any,
        thread: threading.Thread,
        registry: CollectorRegistry,
        *,
        files: LiveMultiProcessCollector,
        collectors: Iterable[Collector] = (),
    ) -> None:
        self._httpd = httpd
        self._thread = thread
        self.registry = registry
        self.files = files
        """The workers' files, merged (one of the registry's collectors)."""
        self.collectors = tuple(collectors)
        """The registry's other collectors (the launcher's own)."""
        self.addr: str = httpd.server_address[0]
        self.port: int = httpd.server_port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.addr in ("0.0.0.0", "") else self.addr
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve_node_metrics(
    addr: str,
    port: int,
    multiproc_dir: str,
    *,
    agent_metrics: AgentMetrics | None = None,
    extra: Iterable[Collector] = (),
) -> NodeMetricsServer:
    """Serve the workers' multiprocess metrics (and the agent's) on ``http://addr:port/metrics``.

    Args:
        addr: bind address (``0.0.0.0``: all IPv4 interfaces; ``::`` for IPv6).
        port: TCP port; 0 picks a free one (read it from the result's ``port``).
        multiproc_dir: the workers' ``PROMETHEUS_MULTIPROC_DIR``; must exist.
        agent_metrics: the agent's metrics to serve alongside, if any.
        extra: more of the launcher's own collectors to serve.

    Raises:
        MetricsError: the directory is missing or the address cannot be bound.
    """
    if not os.path.isdir(multiproc_dir):
        raise MetricsError(f"metrics directory {multiproc_dir} does not exist")
    registry = CollectorRegistry(auto_describe=False)
    files = LiveMultiProcessCollector(multiproc_dir)
    own = [*([agent_metrics] if agent_metrics is not None else []), *extra]
    for collector in [files, *own]:
        registry.register(collector)
    try:
        httpd, thread = start_http_server(port, addr=addr, registry=registry)
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise MetricsError(f"cannot serve metrics on {addr}:{port}: {reason}") from exc
    server = NodeMetricsServer(httpd, thread, registry, files=files, collectors=own)
    log.info("serving node metrics on %s:%d", addr, server.port)
    return server


@dataclass(kw_only=True, slots=True)
class LauncherMetricsConfig:
    """Where and how the launcher serves its node's metrics."""

    addr: str = DEFAULT_METRICS_ADDR
    """Bind address of the endpoint (``--metrics-addr``)."""
    port: int = DEFAULT_METRICS_PORT
    """TCP port of the endpoint (``--metrics-port``); 0 picks a free one."""
    run_id: str = "none"
    """The job's rendezvous id, the ``run_id`` label of the agent's metrics."""
    node: str = field(default_factory=local_node_name)
    """This node's name, the ``node`` label of the agent's metrics and (exported to them as
    ``ELASTIC_TRAINER_NODE``) of the workers'; default ``{short host}-{this pid}``, the name
    ``elastic-trainer status`` derives from the rendezvous (the agent runs in this process)."""
    rdzv_endpoint: str = ""
    """The job's etcd (``host:port[,...]``), served as ``elastic_trainer_job_info`` (none if empty)."""
    multiproc_dir: str | None = None
    """Directory for the workers' metric files; ``None``: ``$PROMETHEUS_MULTIPROC_DIR`` if set,
    else a fresh temporary directory removed on close. Stale ``*.db`` files are deleted."""

    def __post_init__(self) -> None:
        # MetricsError is a ValueError: callers catching either get one clear line.
        if not self.addr:
            raise MetricsError("addr must not be empty")
        if not 0 <= self.port <= 65535:
            raise MetricsError(f"port must be in 0..65535, got {self.port}")
        if not self.run_id:
            raise MetricsError("run_id must not be empty")
        if not self.node:
            raise MetricsError("node must not be empty")


class LauncherMetrics:
    """What :func:`start_launcher_metrics` set up; :meth:`close` undoes all of it."""

    def __init__(
        self,
        *,
        server: NodeMetricsServer,
        agent_metrics: AgentMetrics,
        multiproc_dir: str,
        cleanup: list[Callable[[], None]],
        frozen_workers: FrozenWorkerMetrics,
        owns_directory: bool = False,
    ) -> None:
        self.server = server
        self.agent_metrics = agent_metrics
        self.frozen_workers = frozen_workers
        """The frozen-worker watchdog's counter (served by :attr:`server`)."""
        self.multiproc_dir = multiproc_dir
        self.owns_directory = owns_directory
        """Whether :attr:`multiproc_dir` was made for this launcher (and goes with it)."""
        self._cleanup = cleanup

    @property
    def registry(self) -> CollectorRegistry:
        """What the endpoint serves (workers' files merged, plus the agent's): read it in-process
        (``elastic_trainer.launch.progress_publisher``) instead of scraping the port."""
        return self.server.registry

    def reader(self, families: Iterable[str]) -> FamilyReader:
        """An in-process reader of :attr:`registry`'s ``families`` only (see :class:`FamilyReader`)."""
        return FamilyReader(self.server.files, self.server.collectors, families)

    @property
    def node(self) -> str:
        """This node's name (the ``node`` label)."""
        return self.agent_metrics.node

    @property
    def run_id(self) -> str:
        return self.agent_metrics.run_id

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        """Stop the endpoint, unhook torch elastic, restore the environment. Idempotent."""
        while self._cleanup:
            self._cleanup.pop()()

    def __enter__(self) -> LauncherMetrics:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def start_launcher_metrics(config: LauncherMetricsConfig) -> LauncherMetrics:
    """Prepare the launcher process to serve its node's metrics; call before starting the agent.

    Sets ``PROMETHEUS_MULTIPROC_DIR``, ``ELASTIC_TRAINER_NODE`` (and ``ELASTIC_TRAINER_METRICS=1``
    unless already set) in this process's environment, which the agent passes to every worker
    it starts.

    Raises:
        MetricsError: the directory cannot be prepared, the endpoint cannot be bound, or
            ``ELASTIC_TRAINER_METRICS_ALLREDUCE`` is not a mode.
    """
    allreduce_timing_mode()  # a typo fails here, once, not in every worker the agent starts
    cleanup: list[Callable[[], None]] = []  # run in reverse by close()
    try:
        directory = config.multiproc_dir or os.environ.get(ENV_MULTIPROC_DIR) or None
        owns_directory = directory is None
        if directory is None:
            # Locked by this process: the next launcher's janitor sweep knows whether it is gone.
            owned = OwnedDir("elastic-trainer-metrics-")
            directory = str(owned.path)
            cleanup.append(lambda: shutil.rmtree(directory, ignore_errors=True))
            cleanup.append(owned.release)  # run in reverse: unlocked, then removed
        else:
            _prepare_dir(directory)
        told = LaunchContract(
            metrics_dir=directory, node=config.node, metrics=ENV_METRICS not in os.environ
        )  # the user's ELASTIC_TRAINER_METRICS wins
        cleanup.extend(_set_env(name, value) for name, value in told.to_environ().items())
        agent_metrics = AgentMetrics(run_id=config.run_id, node=config.node)
        frozen_workers = FrozenWorkerMetrics(run_id=config.run_id, node=config.node)
        cleanup.append(install_agent_hooks(agent_metrics))
        job = [JobInfo(run_id=config.run_id, node=config.node, rdzv_endpoint=config.rdzv_endpoint)]
        server = serve_node_metrics(
            config.addr, config.port, directory, agent_metrics=agent_metrics,
            extra=[frozen_workers, *(job if config.rdzv_endpoint else [])],
        )  # fmt: skip
        cleanup.append(server.close)
    except BaseException:
        while cleanup:
            cleanup.pop()()
        raise
    return LauncherMetrics(
        server=server,
        agent_metrics=agent_metrics,
        multiproc_dir=directory,
        cleanup=cleanup,
        frozen_workers=frozen_workers,
        owns_directory=owns_directory,
    )


def _prepare_dir(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        for stale in glob.glob(os.path.join(directory, "*.db")):
            os.remove(stale)
    except OSError as exc:
        raise MetricsError(f"cannot prepare metrics directory {directory}: {exc}") from exc


def _set_env(name: str, value: str) -> Callable[[], None]:
    previous = os.environ.get(name)
    os.environ[name] = value

    def restore() -> None:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous

    return restore
