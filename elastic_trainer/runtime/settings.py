"""Every environment variable a worker process reads, parsed once, into :class:`WorkerSettings`.

A worker's entry point calls :meth:`WorkerSettings.from_environ` once; code below it receives the
settings and never reads ``os.environ``. Precedence for a value that also has a config field:
code or the script's command line > the environment > the default. torchrun's own variables are
parsed by :func:`elastic_trainer.runtime.distributed.read_env`; the launcher imports the names it
sets for its workers from here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from elastic_trainer.runtime.errors import ConfigError
from rendezvous.plugin import WORKER_ENV_CONF, WORKER_ENV_ENDPOINT

ENV_JIT_SAVE = "ELASTIC_TRAINER_JIT_SAVE"
"""``0`` turns off the just-in-time checkpoint of the last completed step on failures."""
ENV_SIGTERM_GRACE_S = "ELASTIC_TRAINER_SIGTERM_GRACE_S"
"""Seconds between SIGTERM and exit in which the ranks checkpoint the step they stopped after."""
ENV_PG_TIMEOUT_S = "ELASTIC_TRAINER_PG_TIMEOUT_S"
"""Process-group (collective) timeout in seconds."""
ENV_METRICS = "ELASTIC_TRAINER_METRICS"
"""``1``: report metrics to the node's endpoint (the launcher sets it)."""
ENV_METRICS_ALLREDUCE = "ELASTIC_TRAINER_METRICS_ALLREDUCE"
"""How gradient allreduces are timed: ``sampled`` (default: DDP's own C++ statistics, one backward
in ten, no comm hook), ``trace`` (CUDA: NCCL's timings from the flight recorder; a CPU model falls
back to ``sampled``) or ``0`` (not at all). ``hook`` (a Python comm hook on every bucket) was
removed in issue 30 and is refused. See ``docs/design/metrics.md``."""
ENV_REPLICA_CHECK_EVERY = "ELASTIC_TRAINER_REPLICA_CHECK_EVERY"
"""Steps between two comparisons of the data-parallel replicas' parameters (default
:data:`DEFAULT_REPLICA_CHECK_EVERY`; ``0``: off). They are also compared after the first two steps
of every start, resume and heal. The checksum rides on the step's control (``docs/design/own-loop.md``)."""
DEFAULT_REPLICA_CHECK_EVERY = 100
ENV_CONTROL_CARRIER = "ELASTIC_TRAINER_CONTROL_CARRIER"
"""``0`` sends the step's control on its own small gloo collective every step. By default (``1``),
on the CPU with gloo and 2 or more ranks, ``Elastic``/``Trainer`` carry it as the gradient of an
extra parameter that DDP reduces with the model's in C++ (``runtime/grad_carrier.py``; about 7 % of
a short step's CPU less), or, for an FSDP2 model, on one unit's reduce-scatter
(``runtime/shard_carrier.py``). Every rank of an attempt decides alike, from the attempt's world
(``docs/design/steady-state.md``, "The control as a gradient"; ``docs/design/sharded.md``)."""
ENV_SHARD_COPY_EVERY = "ELASTIC_TRAINER_SHARD_COPY_EVERY"
"""Steps between refreshes of each sharded (FSDP2) rank's copy on its neighbour, for a loop that
heals sharded state in place (``state/neighbour_copy.py``); ``0`` turns the copy off."""
ENV_NODE = "ELASTIC_TRAINER_NODE"
"""This node's name, ``{short host}-{launcher pid}`` (the launcher sets it)."""
ENV_REPORTS_FAILURES = "ELASTIC_TRAINER_REPORTS_FAILURES"
"""``1``: the launcher prints root causes, so a failing worker prints one line (the launcher sets it)."""
ENV_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's multiprocess directory, served by the node's endpoint (the launcher sets it)."""
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Where torchrun asks each worker to record its failure."""
ENV_RUN_ID = "TORCHELASTIC_RUN_ID"
"""The job's rendezvous id (torchrun sets it)."""
ENV_FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
"""Entries of torch's flight recorder ring (torch reads it once, when the process group starts)."""
ENV_HEAL = "ELASTIC_TRAINER_HEAL"
"""``in_place``: survivors of a fault keep their processes and heal the group in place
(``docs/design/heal-in-place.md``); ``off`` (the default outside ``elastic-trainer run``)."""
ENV_HEAL_JOIN = "ELASTIC_TRAINER_HEAL_JOIN"
"""``1``: this process joins a running job in place (a replacement, a new node, a spare)."""
ENV_HEAL_ENDPOINT = WORKER_ENV_ENDPOINT
"""The job's etcd endpoint(s): the membership's, the diagnostics registry's (the launcher sets
it; under plain torchrun the ``etcd-v3`` rendezvous does, :mod:`rendezvous.plugin`)."""
ENV_HEAL_RDZV_CONF = WORKER_ENV_CONF
"""The job's ``--rdzv-conf`` (etcd TLS and auth settings), for the workers' etcd connection."""
ENV_HEAL_WORLD = "ELASTIC_TRAINER_HEAL_WORLD"
"""``MIN:MAX`` processes a healed group may have (``--nnodes`` times workers per node)."""
ENV_HEAL_SETTLE_S = "ELASTIC_TRAINER_HEAL_SETTLE_S"
"""How long a round waits for members that did not answer before it counts them as gone."""
ENV_HEAL_MARKER = "ELASTIC_TRAINER_HEAL_MARKER"
"""A file a worker that heals in place creates (the warm-start client then replaces it if it dies)."""
ENV_HEAL_TIMEOUT_S = "ELASTIC_TRAINER_HEAL_TIMEOUT_S"
"""How long a round may wait for enough members before the process gives up (exits)."""
ENV_HEARTBEAT_DIR = "ELASTIC_TRAINER_HEARTBEAT_DIR"
"""Where each worker beats for the launcher's frozen-worker watchdog (the launcher sets it)."""
ENV_STOPPING_FILE = "ELASTIC_TRAINER_STOPPING_FILE"
"""A file that exists while the launcher stops its workers (warm start): a stop signal that
arrives while it does not exist was not the launcher's (``runtime.signals.lone_signal``)."""
ENV_LAUNCHER_ID = "ELASTIC_TRAINER_LAUNCHER_ID"
"""``{launcher pid}-{random}``: marks every process of one launcher, so that its janitor finds them
after the launcher is SIGKILLed."""
ENV_DEBUG_HOST = "ELASTIC_TRAINER_DEBUG_HOST"
"""Where each worker's diagnostics endpoint listens (``train/diagnostics.py``): default
:data:`DEFAULT_DEBUG_HOST`, this node only; ``0.0.0.0`` (or an address) for ``elastic-trainer
debug`` from other hosts; ``off``: no endpoint."""
DEFAULT_DEBUG_HOST = "127.0.0.1"
ENV_DEBUG_PORT = "ELASTIC_TRAINER_DEBUG_PORT"
"""The diagnostics endpoint's port: this base plus the worker's local rank, a fixed range a
NetworkPolicy can open (the Helm chart's ``workers.diagnostics``); 0 (the default): a free port."""
DEBUG_PROFILE_HANDLER = "elastic_trainer_profile"
"""The endpoint's handler of ours: ``POST /handler/elastic_trainer_profile?steps=N&timeout=S``
answers a ``torch.profiler`` trace of the loop's next N steps."""
RECENT_LINES_HANDLER = "elastic_trainer_recent_lines"
"""A launcher's endpoint: its newest log lines (its view of the job's faults)."""

DEFAULT_SIGTERM_GRACE_S = 30.0
"""torchrun's agent SIGKILLs workers 30 s after its SIGTERM: a larger grace buys nothing there."""
DEFAULT_PG_TIMEOUT_S = 30 * 60.0
"""torch's own default, as the DDP guides advise for skewed ranks; a dead rank is still noticed at
once (its process exits and the agent restarts the group)."""
DEFAULT_FR_BUFFER_ENTRIES = 2000
"""torch's default flight-recorder ring size."""

ALLREDUCE_TIMING_MODES = {"1": "sampled", "true": "sampled", "yes": "sampled", "sampled": "sampled",
                          "trace": "trace", "0": "off", "false": "off", "no": "off"}  # fmt: skip
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}: {environ[name]!r} is not a boolean (use 1 or 0)")


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}: must be a positive number of seconds, got {raw!r}")
    return value


def env_int(environ: Mapping[str, str], name: str) -> int | None:
    """The integer in ``environ[name]``; ``None`` when it is unset or blank.

    Raises:
        ConfigError: not an integer (the message names ``name``)."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not an integer") from None


def allreduce_timing_mode(raw: str | None) -> str:
    """``sampled``, ``trace`` or ``off`` from a :data:`ENV_METRICS_ALLREDUCE` value
    (unset: ``sampled``).

    Raises:
        ConfigError: anything else, and the removed ``hook`` mode (said so, with what replaces it).
    """
    value = (raw if raw is not None else "sampled").strip().lower()
    mode = ALLREDUCE_TIMING_MODES.get(value)
    if value == "hook":
        raise ConfigError(
            f"{ENV_METRICS_ALLREDUCE}=hook was removed (a Python comm hook on every gradient "
            "bucket slowed the step): use sampled (the default) or trace"
        )
    if mode is None:
        raise ConfigError(f"{ENV_METRICS_ALLREDUCE}={raw!r}: expected sampled, trace or 0")
    return mode


DEFAULT_HEAL_SETTLE_S = 0.5
"""A live member answers a round on its watch thread within milliseconds; half a second covers a
loaded machine's scheduling delays many times over."""
DEFAULT_HEAL_TIMEOUT_S = 600.0
"""Like torchrun's join timeout: how long survivors below the minimum wait for new members."""


def _world(environ: Mapping[str, str], name: str) -> tuple[int, int] | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    low, _, high = raw.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not MIN:MAX") from None
    if not 1 <= lo <= hi:
        raise ConfigError(f"{name}: need 1 <= MIN <= MAX, got {raw!r}")
    return lo, hi


@dataclass(frozen=True, kw_only=True, slots=True)
class HealSettings:
    """In-place healing (:data:`ENV_HEAL` and the variables beside it)."""

    enabled: bool = False
    join: bool = False
    """This process joins a running job (:data:`ENV_HEAL_JOIN`)."""
    endpoint: str | None = None
    rdzv_conf: str = ""
    world: tuple[int, int] | None = None
    """``(min, max)`` processes; ``None``: the size torchrun formed, fixed."""
    settle_s: float = DEFAULT_HEAL_SETTLE_S
    timeout_s: float = DEFAULT_HEAL_TIMEOUT_S
    marker: str | None = None
    """(:data:`ENV_HEAL_MARKER`) created once this process heals in place."""

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> HealSettings:
        raw = env.get(ENV_HEAL, "").strip().lower()
        if raw not in ("", "off", "0", "in_place", "1"):
            raise ConfigError(f"{ENV_HEAL}: {env[ENV_HEAL]!r} is not in_place or off")
        enabled = raw in ("in_place", "1")
        endpoint = env.get(ENV_HEAL_ENDPOINT, "").strip() or None
        if enabled and endpoint is None:
            raise ConfigError(f"{ENV_HEAL}=in_place needs {ENV_HEAL_ENDPOINT} (the job's etcd)")
        return cls(
            enabled=enabled,
            join=_bool(env, ENV_HEAL_JOIN, False),
            endpoint=endpoint,
            rdzv_conf=env.get(ENV_HEAL_RDZV_CONF, ""),
            world=_world(env, ENV_HEAL_WORLD),
            settle_s=_seconds(env, ENV_HEAL_SETTLE_S, DEFAULT_HEAL_SETTLE_S),
            timeout_s=_seconds(env, ENV_HEAL_TIMEOUT_S, DEFAULT_HEAL_TIMEOUT_S),
            marker=env.get(ENV_HEAL_MARKER) or None,
        )

    def to_environ(self) -> dict[str, str]:
        """The variables :meth:`from_environ` reads back as this value (defaults left out)."""
        env = {
            ENV_HEAL: "in_place" if self.enabled else "off",
            ENV_HEAL_JOIN: "1" if self.join else "0",
        }
        if self.endpoint is not None:
            env[ENV_HEAL_ENDPOINT] = self.endpoint
        if self.rdzv_conf:
            env[ENV_HEAL_RDZV_CONF] = self.rdzv_conf
        if self.world is not None:
            env[ENV_HEAL_WORLD] = f"{self.world[0]}:{self.world[1]}"
        if self.settle_s != DEFAULT_HEAL_SETTLE_S:
            env[ENV_HEAL_SETTLE_S] = repr(self.settle_s)
        if self.timeout_s != DEFAULT_HEAL_TIMEOUT_S:
            env[ENV_HEAL_TIMEOUT_S] = repr(self.timeout_s)
        if self.marker is not None:
            env[ENV_HEAL_MARKER] = self.marker
        return env


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchContract:
    """What ``elastic-trainer run`` tells each of its workers: the one definition of the
    launcher-to-worker contract. The launcher writes it with :meth:`to_environ` (every worker,
    cold or warm-forked, inherits the variables); a worker reads it with :meth:`from_environ`
    (through :meth:`WorkerSettings.from_environ`). A field left at its default writes nothing,
    so the launcher can write the parts it knows at each stage of its start."""

    node: str | None = None
    """This node's name (:data:`ENV_NODE`)."""
    reports_failures: bool = False
    """The launcher prints root causes, so a failing worker prints one line (:data:`ENV_REPORTS_FAILURES`)."""
    metrics: bool = False
    """Workers report to the node's metrics endpoint (:data:`ENV_METRICS`)."""
    metrics_dir: str | None = None
    """prometheus-client's multiprocess directory the endpoint serves (:data:`ENV_MULTIPROC_DIR`)."""
    heal: HealSettings | None = None
    """In-place healing (:data:`ENV_HEAL` and the variables beside it); ``None``: not written."""
    heartbeat_dir: str | None = None
    """The frozen-worker watchdog's directory (:data:`ENV_HEARTBEAT_DIR`)."""
    stopping_file: str | None = None
    """The warm server's agent-stopping file (:data:`ENV_STOPPING_FILE`)."""
    launcher_id: str | None = None
    """Marks the launcher's processes for its janitor (:data:`ENV_LAUNCHER_ID`)."""

    def to_environ(self) -> dict[str, str]:
        """The variables of the fields that are set (see the class docstring)."""
        env: dict[str, str] = {}
        texts = ((ENV_NODE, self.node), (ENV_MULTIPROC_DIR, self.metrics_dir), (ENV_HEARTBEAT_DIR, self.heartbeat_dir),
                 (ENV_STOPPING_FILE, self.stopping_file), (ENV_LAUNCHER_ID, self.launcher_id))  # fmt: skip
        env.update((name, value) for name, value in texts if value is not None)
        if self.reports_failures:
            env[ENV_REPORTS_FAILURES] = "1"
        if self.metrics:
            env[ENV_METRICS] = "1"
        if self.heal is not None:
            env.update(self.heal.to_environ())
        return env

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> LaunchContract:
        """Read the contract back (absent variables: the defaults).

        Raises:
            ConfigError: a variable holds a value of the wrong kind; the message names it.
        """
        heal = HealSettings.from_environ(env) if ENV_HEAL in env else None
        return cls(node=env.get(ENV_NODE) or None, reports_failures=env.get(ENV_REPORTS_FAILURES, "").strip() == "1",
                   metrics=_bool(env, ENV_METRICS, False), metrics_dir=env.get(ENV_MULTIPROC_DIR) or None, heal=heal,
                   heartbeat_dir=env.get(ENV_HEARTBEAT_DIR) or None, stopping_file=env.get(ENV_STOPPING_FILE) or None,
                   launcher_id=env.get(ENV_LAUNCHER_ID) or None)  # fmt: skip


def debug_host_of(environ: Mapping[str, str]) -> str | None:
    """The diagnostics endpoints' host from :data:`ENV_DEBUG_HOST` (``None``: off)."""
    raw = environ.get(ENV_DEBUG_HOST, "").strip()
    if raw.lower() in _FALSE:
        return None
    return raw or DEFAULT_DEBUG_HOST


def _debug_port(environ: Mapping[str, str]) -> int:
    port = env_int(environ, ENV_DEBUG_PORT) or 0
    if not 0 <= port <= 65000:
        raise ConfigError(f"{ENV_DEBUG_PORT}: {port} is not a port base in 0..65000")
    return port


def _replica_check_every(environ: Mapping[str, str]) -> int:
    every = env_int(environ, ENV_REPLICA_CHECK_EVERY)
    if every is None:
        return DEFAULT_REPLICA_CHECK_EVERY
    if every < 0:
        raise ConfigError(f"{ENV_REPLICA_CHECK_EVERY}={every}: must be 0 (off) or a step count")
    return every


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSettings:
    """What a worker process takes from its environment (see the module docstring)."""

    jit_save: bool = True
    """Save the last completed step just in time when the group fails (:data:`ENV_JIT_SAVE`)."""
    sigterm_grace_s: float = DEFAULT_SIGTERM_GRACE_S
    """Seconds from SIGTERM to exit (:data:`ENV_SIGTERM_GRACE_S`)."""
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S
    """Collective timeout (:data:`ENV_PG_TIMEOUT_S`)."""
    metrics: bool = False
    """Report to the node's metrics endpoint (:data:`ENV_METRICS`)."""
    metrics_allreduce: str = "sampled"
    """``sampled``, ``trace`` or ``off`` (:data:`ENV_METRICS_ALLREDUCE`)."""
    metrics_dir: str | None = None
    """prometheus-client's multiprocess directory (:data:`ENV_MULTIPROC_DIR`)."""
    node: str | None = None
    """This node's name (:data:`ENV_NODE`); ``None`` outside ``elastic-trainer run``."""
    run_id: str | None = None
    """The job's rendezvous id (:data:`ENV_RUN_ID`)."""
    error_file: str | None = None
    """torchrun's error file for this worker (:data:`ENV_ERROR_FILE`)."""
    launcher_reports_failures: bool = False
    """The launcher prints root causes (:data:`ENV_REPORTS_FAILURES`)."""
    fr_buffer_entries: int = DEFAULT_FR_BUFFER_ENTRIES
    """torch's flight-recorder ring size (:data:`ENV_FR_BUFFER_SIZE`)."""
    rank: int = 0
    """torchrun's ``RANK`` (0 for a process started by hand), for labels and reports."""
    local_rank: int = 0
    """torchrun's ``LOCAL_RANK``."""
    heal: HealSettings = HealSettings()
    """In-place healing."""
    control_carrier: bool = True
    """The step's control rides on a gradient where it can (:data:`ENV_CONTROL_CARRIER`)."""
    replica_check_every: int = DEFAULT_REPLICA_CHECK_EVERY
    """Compare the replicas' parameters every this many steps, 0: never
    (:data:`ENV_REPLICA_CHECK_EVERY`; ``docs/design/own-loop.md``)."""
    debug_host: str | None = DEFAULT_DEBUG_HOST
    """Where the diagnostics endpoint listens; ``None``: none (:data:`ENV_DEBUG_HOST`)."""
    debug_port: int = 0
    """Its port base (:data:`ENV_DEBUG_PORT`): the port is this plus the local rank; 0: free."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerSettings:
        """Parse the worker's environment (default ``os.environ``), once.

        Raises:
            ConfigError: a variable holds a value of the wrong kind; the message names it.
        """
        env = os.environ if environ is None else environ
        ring = env_int(env, ENV_FR_BUFFER_SIZE)
        launch = LaunchContract.from_environ(env)  # what the launcher said, read in one place
        return cls(
            jit_save=_bool(env, ENV_JIT_SAVE, True),
            sigterm_grace_s=_seconds(env, ENV_SIGTERM_GRACE_S, DEFAULT_SIGTERM_GRACE_S),
            pg_timeout_s=_seconds(env, ENV_PG_TIMEOUT_S, DEFAULT_PG_TIMEOUT_S),
            metrics=launch.metrics,
            metrics_allreduce=allreduce_timing_mode(env.get(ENV_METRICS_ALLREDUCE)),
            metrics_dir=launch.metrics_dir,
            node=launch.node,
            run_id=env.get(ENV_RUN_ID) or None,
            error_file=env.get(ENV_ERROR_FILE) or None,
            launcher_reports_failures=launch.reports_failures,
            fr_buffer_entries=DEFAULT_FR_BUFFER_ENTRIES if ring is None else ring,
            rank=env_int(env, "RANK") or 0,
            local_rank=env_int(env, "LOCAL_RANK") or 0,
            heal=launch.heal if launch.heal is not None else HealSettings.from_environ(env),
            control_carrier=_bool(env, ENV_CONTROL_CARRIER, True),
            replica_check_every=_replica_check_every(env),
            debug_host=debug_host_of(env),
            debug_port=_debug_port(env),
        )


def check_positive(name: str, value: float | int | None, *, allow_none: bool = False) -> None:
    """A config field's check: a positive number (``None`` too with ``allow_none``).

    Raises:
        ConfigError: naming ``name``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}: must be a positive number, got {value!r}")


def check_positive_int(name: str, value: int | None, *, allow_none: bool = False) -> None:
    """A config field's check: a positive integer (``None`` too with ``allow_none``).

    Raises:
        ConfigError: naming ``name``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: must be a positive integer, got {value!r}")


def check_bool(name: str, value: object, *, allow_none: bool = False) -> None:
    """A config field's check: ``True`` or ``False`` (``None`` too with ``allow_none``).

    Raises:
        ConfigError: naming ``name``."""
    if value is None and allow_none:
        return
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: must be true or false, got {value!r}")
