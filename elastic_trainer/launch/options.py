"""Options of ``elastic-trainer run``: one table (:data:`OPTIONS`), four sources, one precedence.

Every option comes, in order of precedence, from the command line, from the environment variable
``ELASTIC_TRAINER_<NAME>`` (``--rdzv-endpoint`` -> ``ELASTIC_TRAINER_RDZV_ENDPOINT``), from the
``[run]`` table of a TOML file given by ``--config`` (or ``ELASTIC_TRAINER_CONFIG``), or from the
default. An unknown key in the file is an error, not silently ignored. The defaults and why they
suit elastic work: ``docs/design/launcher.md``; ``elastic-trainer run --help`` lists them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomllib

from elastic_trainer.runtime.failures import UserError

ENV_PREFIX = "ELASTIC_TRAINER_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"


def _positive_int(text: Any) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _positive_float(text: Any) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def _frozen_timeout(text: Any) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("not a number of seconds") from None
    if not (value == 0 or 1 <= value < float("inf")):
        raise ValueError("must be 0 (off) or at least 1 second")
    return value


def _port(text: Any) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a port number in 0..65535")
    return value


def _nnodes(text: Any) -> str:
    text = str(text).strip()
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if lo < 1 or hi < lo:
        raise ValueError("must be N or MIN:MAX with 1 <= MIN <= MAX")
    return f"{lo}:{hi}"


def _nproc(text: Any) -> str:
    text = str(text).strip()
    if text == "auto":
        return text
    if int(text) < 1:
        raise ValueError("must be 'auto' or a positive integer")
    return str(int(text))


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(text: Any) -> str:
        if str(text) not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return str(text)

    return parse


def _text(text: Any) -> str:
    value = str(text).strip()
    if not value:
        raise ValueError("must not be empty")
    return value


def _modules(text: Any) -> str:
    names = [name.strip() for name in str(text).split(",") if name.strip()]
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"{name!r} is not a module name")
    return ",".join(names)


def _rdzv_conf(text: Any) -> str:
    value = str(text).strip()
    for item in filter(None, value.split(",")):
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{item!r} is not KEY=VALUE")
    return value


@dataclass(frozen=True, slots=True)
class OptionSpec:
    """One option: its parser, default and help."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    """Other spellings on the command line (torchrun's)."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        """The flag, its underscore spelling (torchrun accepts both), and the aliases."""
        underscore = "--" + self.name
        return tuple(dict.fromkeys((self.flag, *((underscore,) if underscore != self.flag else ()), *self.aliases)))

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec("nnodes", _nnodes, "1:2", "number of nodes, N or MIN:MAX"),
    OptionSpec("nproc_per_node", _nproc, "auto", "workers per node ('auto': one per GPU, else 1)"),
    OptionSpec("rdzv_endpoint", _text, None, "etcd endpoint(s) host:port[,host:port]; none: embedded etcd"),
    OptionSpec("run_id", _text, None, "rendezvous id of the job (required with --rdzv-endpoint)",
               aliases=("--rdzv-id", "--rdzv_id")),
    OptionSpec("rdzv_conf", _rdzv_conf, "", "extra rendezvous settings KEY=VALUE[,KEY=VALUE] (TLS, auth, ...)"),
    OptionSpec("max_restarts", _positive_int, 3, "worker group restarts before the job fails"),
    OptionSpec("monitor_interval", _positive_float, 0.1, "seconds between worker health checks"),
    OptionSpec("join_timeout", _positive_int, 600, "seconds to wait for the minimum number of nodes"),
    OptionSpec("last_call_timeout", _positive_int, 5, "seconds to admit more nodes once the minimum is there"),
    OptionSpec("lease_ttl", _positive_int, 10, "seconds after which a dead node's membership expires"),
    OptionSpec("close_timeout", _positive_int, 30, "seconds for a round to close after a shutdown"),
    OptionSpec("heartbeat_timeout", _positive_int, 30, "seconds without heartbeat before a node is dead"),
    OptionSpec("keep_alive_interval", _positive_int, 5, "seconds between a node's heartbeats"),
    OptionSpec("metrics_port", _port, 9400, "Prometheus endpoint port of this node (0: metrics off)"),
    OptionSpec("metrics_addr", _text, "0.0.0.0", "bind address of the metrics endpoint"),
    OptionSpec("device", _choice("auto", "cpu", "cuda"), "auto", "worker device: auto, cpu or cuda"),
    OptionSpec("etcd_host", _text, "127.0.0.1", "listen address of the embedded etcd"),
    OptionSpec("log_dir", _text, None, "directory for per-worker logs (default: inherit the console)"),
    OptionSpec("warm_start", _choice("on", "off"), "on", "fork restarted workers from a process with torch imported"),
    OptionSpec("warm_preload", _modules, "", "extra modules the warm server imports (comma-separated)"),
    OptionSpec("frozen_timeout", _frozen_timeout, 10.0,
               "seconds a live worker may make no progress before it is stopped as frozen "
               "(5x the median step time if longer; 0: off)"),
    OptionSpec("heal", _choice("in_place", "off"), "in_place",
               "in_place: survivors of a fault keep their processes and state, only what died restarts; "
               "off: every fault restarts every worker (plain torchrun)"),
)
OPTIONS_BY_NAME = {spec.name: spec for spec in OPTIONS}


@dataclass(kw_only=True, slots=True)
class RunOptions:
    """The resolved options of one ``elastic-trainer run``."""

    nnodes: str
    """``MIN:MAX`` nodes."""
    nproc_per_node: str
    """Workers per node, or ``auto``."""
    rdzv_endpoint: str | None
    """etcd endpoint(s); ``None`` starts an embedded etcd."""
    run_id: str | None
    """Rendezvous id; derived when ``None`` and etcd is embedded."""
    rdzv_conf: str
    """Extra ``KEY=VALUE`` rendezvous settings."""
    max_restarts: int
    """Worker group restarts before failing."""
    monitor_interval: float
    """Seconds between health checks."""
    join_timeout: int
    """Seconds to reach the minimum of nodes."""
    last_call_timeout: int
    """Seconds to admit extra nodes."""
    lease_ttl: int
    """Seconds before a dead node's etcd lease expires."""
    close_timeout: int
    """Seconds for a round to close."""
    heartbeat_timeout: int
    """Seconds before a silent node is dead."""
    keep_alive_interval: int
    """Seconds between heartbeats."""
    metrics_port: int
    """Metrics endpoint port; 0 disables metrics."""
    metrics_addr: str
    """Metrics endpoint bind address."""
    device: str
    """auto, cpu or cuda."""
    etcd_host: str
    """Embedded etcd listen address."""
    log_dir: str | None
    """Per-worker log directory, or ``None`` for the console."""
    warm_start: str
    """``on``: workers are forked from a warm server (:mod:`elastic_trainer.launch.warm_start`)."""
    warm_preload: str
    """Extra comma-separated modules the warm server imports."""
    frozen_timeout: float
    """Least silence, seconds, after which the watchdog stops a frozen worker; 0 turns it off
    (:mod:`elastic_trainer.launch.watchdog`)."""
    heal: str = "in_place"
    """``in_place`` or ``off`` (:mod:`elastic_trainer.launch.in_place`)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each value came from (cli, env, file, default): shown by ``--dry-run``."""

    def __post_init__(self) -> None:
        if self.keep_alive_interval >= self.heartbeat_timeout:
            raise UserError(
                f"keep_alive_interval ({self.keep_alive_interval}s) must be shorter than "
                f"heartbeat_timeout ({self.heartbeat_timeout}s)"
            )

    @property
    def min_nodes(self) -> int:
        return int(self.nnodes.split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])  # "N" (built in code) or "MIN:MAX" (parsed)


def load_config_file(path: str) -> dict[str, Any]:
    """Read the ``[run]`` table of a TOML file.

    Raises:
        UserError: unreadable file, invalid TOML, or an unknown key.
    """
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise UserError(f"config file {path}: cannot read it ({exc.strerror or exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path}: invalid TOML ({exc})") from exc
    unknown_tables = set(data) - {"run"}
    if unknown_tables:
        raise UserError(f"config file {path}: unknown table or key {sorted(unknown_tables)[0]!r} (expected [run])")
    table = data.get("run", {})
    if not isinstance(table, dict):
        raise UserError(f"config file {path}: 'run' must be a table")
    normalized = {key.replace("-", "_"): value for key, value in table.items()}
    unknown = sorted(set(normalized) - set(OPTIONS_BY_NAME))
    if unknown:
        raise UserError(f"config file {path}: unknown key {unknown[0]!r} in [run]")
    return normalized


def resolve_run_options(
    cli: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    config_path: str | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> RunOptions:
    """Merge the sources with precedence CLI > env > file > default and validate each value.

    Args:
        cli: values given on the command line (``None`` means not given).
        env: the environment (``os.environ`` by default).
        config_path: a TOML file; defaults to ``$ELASTIC_TRAINER_CONFIG``.
        defaults: per-command replacements of the table's defaults.

    Raises:
        UserError: a bad value (naming the option and where it came from) or a bad file.
    """
    env = os.environ if env is None else env
    config_path = config_path or env.get(CONFIG_ENV) or None
    file_values = load_config_file(config_path) if config_path else {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for spec in OPTIONS:
        for source, raw in (
            ("command line " + spec.flag, cli.get(spec.name)),
            ("environment " + spec.env, env.get(spec.env)),
            (f"config file {config_path} key {spec.name}", file_values.get(spec.name)),
        ):
            if raw is not None:
                try:
                    values[spec.name] = spec.parse(raw)
                except (TypeError, ValueError) as exc:
                    reason = str(exc) if not str(exc).startswith("invalid literal") else "not a number"
                    raise UserError(f"{source}: bad value {raw!r} ({reason})") from None
                sources[spec.name] = source.split(" ")[0]
                break
        else:
            values[spec.name] = (defaults or {}).get(spec.name, spec.default)
            sources[spec.name] = "default"
    return RunOptions(**values, sources=sources)


def option_names() -> list[str]:
    return [f.name for f in fields(RunOptions) if f.name != "sources"]


def existing_path(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise UserError(f"{text}: no such file or directory")
    return path
