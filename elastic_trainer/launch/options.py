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
from typing import Any

import tomllib

from elastic_trainer.runtime.failures import UserError
from rendezvous.conf_keys import KEYS_BY_NAME, RendezvousConfigError

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
    """One option: its parser, default and help (read off a :class:`RunOptions` field)."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    """Other spellings on the command line (torchrun's)."""
    rendezvous_key: bool = False
    """The option is also an ``etcd-v3`` ``--rdzv-conf`` key of the same name (its parser and
    meaning come from :data:`rendezvous.conf_keys.KEYS`), passed to torchrun's rendezvous."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        """The flag, its underscore spelling (torchrun accepts both), and the aliases."""
        underscore = "--" + self.name
        return tuple(
            dict.fromkeys(
                (self.flag, *((underscore,) if underscore != self.flag else ()), *self.aliases)
            )
        )

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


_SPEC = "option"  # the key of a RunOptions field's metadata that holds its OptionSpec parts


def _option(
    default: Any, parse: Callable[[Any], Any], help: str, *, aliases: tuple[str, ...] = ()
) -> Any:
    """A :class:`RunOptions` field that is an option of ``elastic-trainer run``."""
    return field(default=default, metadata={_SPEC: (parse, help, aliases, False)})


def _rendezvous_option(name: str, *, launcher_default: Any = None) -> Any:
    """A :class:`RunOptions` field that is the ``--rdzv-conf`` key ``name``: its parser, meaning and
    default are the key's own (:data:`rendezvous.conf_keys.KEYS`), unless ``launcher_default``
    replaces the default for this launcher (the reason is stated where it is used)."""
    key = KEYS_BY_NAME[name]

    def parse(raw: Any) -> Any:
        try:
            value = key.parse(name, raw)
        except RendezvousConfigError as exc:  # "rdzv-conf KEY: 'x' is not a number" -> the problem
            raise ValueError(str(exc).partition(": ")[2] or str(exc)) from exc
        if not value > 0:
            raise ValueError("must be > 0")
        return value

    default = key.default if launcher_default is None else launcher_default
    return field(default=default, metadata={_SPEC: (parse, key.doc, (), True)})


@dataclass(kw_only=True, slots=True)
class RunOptions:
    """The resolved options of one ``elastic-trainer run``: each field is one option, defined
    once here (parser, default, help); :data:`OPTIONS` is read off these fields."""

    nnodes: str = _option("1:2", _nnodes, "number of nodes, N or MIN:MAX")
    nproc_per_node: str = _option("auto", _nproc, "workers per node ('auto': one per GPU, else 1)")
    rdzv_endpoint: str | None = _option(
        None, _text, "etcd endpoint(s) host:port[,host:port]; none: embedded etcd"
    )
    run_id: str | None = _option(
        None,
        _text,
        "rendezvous id of the job (required with --rdzv-endpoint)",
        aliases=("--rdzv-id", "--rdzv_id"),
    )
    rdzv_conf: str = _option(
        "", _rdzv_conf, "extra rendezvous settings KEY=VALUE[,KEY=VALUE] (TLS, auth, ...)"
    )
    max_restarts: int = _option(3, _positive_int, "worker group restarts before the job fails")
    monitor_interval: float = _option(0.1, _positive_float, "seconds between worker health checks")
    join_timeout: float = _rendezvous_option("join_timeout")
    # A launcher starts its nodes together: 5 s admits the rest of a starting job without making a
    # one-node start wait torch's 30 s (plain torchrun keeps the key's own default).
    last_call_timeout: float = _rendezvous_option("last_call_timeout", launcher_default=5.0)
    lease_ttl: int = _rendezvous_option("lease_ttl")
    metrics_port: int = _option(
        9400, _port, "Prometheus endpoint port of this node (0: metrics off)"
    )
    metrics_addr: str = _option("0.0.0.0", _text, "bind address of the metrics endpoint")
    device: str = _option(
        "auto", _choice("auto", "cpu", "cuda"), "worker device: auto, cpu or cuda"
    )
    etcd_host: str = _option("127.0.0.1", _text, "listen address of the embedded etcd")
    log_dir: str | None = _option(
        None, _text, "directory for per-worker logs (default: inherit the console)"
    )
    warm_start: str = _option(
        "on", _choice("on", "off"), "fork restarted workers from a process with torch imported"
    )
    warm_preload: str = _option(
        "", _modules, "extra modules the warm server imports (comma-separated)"
    )
    frozen_timeout: float = _option(
        10.0,
        _frozen_timeout,
        "seconds a live worker may make no progress before it is stopped as frozen "
        "(5x the median step time if longer; 0: off)",
    )
    progress_interval: float = _option(
        10.0,  # progress_publisher.DEFAULT_INTERVAL_S (not imported: options stay etcd-free)
        _positive_float,
        "seconds between the progress records `elastic-trainer status` shows while the job "
        "does not move, and between their lease renewals (while training, rank 0's node writes "
        "one each time the step moves, read every 0.5 s)",
    )
    heal: str = _option(
        "in_place",
        _choice("in_place", "off"),
        "in_place: survivors of a fault keep their processes and state, only what died restarts; "
        "off: every fault restarts every worker (plain torchrun)",
    )
    sources: dict[str, str] = field(default_factory=dict)
    """Where each value came from (cli, env, file, default): shown by ``--dry-run``."""

    @property
    def min_nodes(self) -> int:
        return int(self.nnodes.split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])  # "N" (built in code) or "MIN:MAX" (parsed)


def _specs() -> tuple[OptionSpec, ...]:
    specs = []
    for item in fields(RunOptions):
        if _SPEC in item.metadata:
            parse, text, aliases, rendezvous_key = item.metadata[_SPEC]
            specs.append(OptionSpec(item.name, parse, item.default, text, aliases, rendezvous_key))
    return tuple(specs)


OPTIONS: tuple[OptionSpec, ...] = _specs()
"""Every option of ``elastic-trainer run`` (and ``doctor``), in :class:`RunOptions` field order."""
OPTIONS_BY_NAME = {spec.name: spec for spec in OPTIONS}


def rendezvous_conf(options: RunOptions) -> str:
    """The ``--rdzv-conf`` string of this launch: the rendezvous options first, the user's
    ``--rdzv-conf`` keys last (they win)."""
    ours = ",".join(
        f"{spec.name}={getattr(options, spec.name)}" for spec in OPTIONS if spec.rendezvous_key
    )
    return ",".join(filter(None, (ours, options.rdzv_conf)))


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
        raise UserError(
            f"config file {path}: unknown table or key {sorted(unknown_tables)[0]!r} (expected [run])"
        )
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
                    reason = (
                        str(exc) if not str(exc).startswith("invalid literal") else "not a number"
                    )
                    raise UserError(f"{source}: bad value {raw!r} ({reason})") from None
                sources[spec.name] = source.split(" ")[0]
                break
        else:
            values[spec.name] = (defaults or {}).get(spec.name, spec.default)
            sources[spec.name] = "default"
    return RunOptions(**values, sources=sources)
