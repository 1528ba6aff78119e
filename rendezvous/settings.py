"""The settings of the ``etcd-v3`` rendezvous: one parser of the ``--rdzv-conf`` key table.

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=etcd:2379 --rdzv-id=job-42 \\
             --rdzv-conf=join_timeout=300,lease_ttl=10 --nnodes=1:4 train.py

:data:`~rendezvous.conf_keys.KEYS` (in :mod:`rendezvous.conf_keys`) is the only list of
``--rdzv-conf`` keys (name, parser, default, meaning, which part uses it); :func:`parse_settings` is the only reader of torchrun's ``RendezvousParameters``, and
everything else (the handler, ``elastic-trainer run`` and ``status``) takes the
:class:`RendezvousSettings` it returns. Invariants:

* every mistake is a :class:`RendezvousConfigError` with one line, ``rdzv-conf KEY: <problem>``;
  an unknown key names its closest known key and lists them all;
* ``handler=lease`` is accepted (command lines may pass it); ``handler=dynamic`` was retired and
  says so;
* the keys torchrun adds itself (``timeout``, and ``rank`` for the static backend) are accepted
  and ignored: ``join_timeout`` bounds a rendezvous here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rendezvous.conf_keys import (  # noqa: F401 (re-exported)
    DEFAULT_KEY_PREFIX,
    DEFAULT_TTL,
    KEYS,
    KEYS_BY_NAME,
    ConfKey,
    RendezvousConfigError,
    conf_keys_table,
    known_keys,
    optional_text,
    parse_conf_string,
    unknown_key_message,
)
from rendezvous.etcd_config import (
    Endpoint,
    EtcdClientConfig,
    check_security,
    parse_endpoints,
    read_secret_file,
)

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

# Keys that are fields of RendezvousSettings under the same name.
_FIELD_KEYS = tuple(k for k in KEYS if k.used_by != "torchrun" and k.name != "password_file")


def _default(name: str) -> Any:
    return KEYS_BY_NAME[name].default


@dataclass(kw_only=True, slots=True)
class RendezvousSettings:
    """Everything the ``etcd-v3`` rendezvous of one node is configured with, validated."""

    run_id: str
    """The job's rendezvous id (``--rdzv-id``)."""
    endpoints: tuple[Endpoint, ...] = ()
    """The etcd cluster's client addresses (``--rdzv-endpoint``); required to connect."""
    min_nodes: int = 1
    """Nodes needed to start (``--nnodes MIN:MAX``)."""
    max_nodes: int = 1
    """Nodes admitted at most."""
    local_addr: str | None = None
    """This node's address as others reach it (``--local-addr``); default: its FQDN."""
    read_timeout: float = _default("read_timeout")
    """gRPC deadline of one etcd request, seconds."""
    retry_timeout: float = _default("retry_timeout")
    """Total time transient etcd faults are retried, seconds."""
    protocol: str = _default("protocol")
    """``http`` or ``https``."""
    ca_cert: str | None = None
    """CA certificate (PEM) of the etcd servers."""
    ssl_cert: str | None = None
    """Client certificate (PEM) for mutual TLS."""
    ssl_cert_key: str | None = None
    """Private key (PEM) of ``ssl_cert``."""
    user: str | None = None
    """etcd user, when etcd auth is on."""
    password: str | None = field(default=None, repr=False)
    """That user's password (from ``password`` or the file ``password_file``)."""
    key_prefix: str = _default("key_prefix")
    """etcd prefix of all runs."""
    ttl: int = _default("ttl")
    """Seconds an untouched rendezvous state lives."""
    handler: str = _default("handler")
    """Always ``lease`` (the one handler); the key stays for command lines that pass it."""
    join_timeout: float = _default("join_timeout")
    """Seconds ``next_rendezvous`` may take."""
    last_call_timeout: float = _default("last_call_timeout")
    """Seconds to admit more nodes once the minimum is in."""
    lease_ttl: int = _default("lease_ttl")
    """Seconds after which a silent (dead) node's membership expires."""
    conf: str = field(default="", repr=False)
    """The ``--rdzv-conf`` text these settings were read from, handed on unchanged (to torchrun,
    to the workers): a ``password_file`` stays a file name, its secret is not written out."""

    def __post_init__(self) -> None:
        if not self.run_id:
            raise RendezvousConfigError("run id: must not be empty")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise RendezvousConfigError(
                f"nnodes: need 1 <= min ({self.min_nodes}) <= max ({self.max_nodes})"
            )
        for name in (
            "read_timeout",
            "retry_timeout",
            "join_timeout",
            "last_call_timeout",
            "ttl",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise RendezvousConfigError(f"rdzv-conf {name}: must be > 0, got {value:g}")
        if self.lease_ttl < 2:
            raise RendezvousConfigError(
                f"rdzv-conf lease_ttl: must be >= 2 seconds, got {self.lease_ttl}"
            )
        if self.handler == "dynamic":
            raise RendezvousConfigError(
                "rdzv-conf handler: 'dynamic' (torch's dynamic rendezvous) was retired; "
                "omit handler to use the lease handler"
            )
        if self.handler != "lease":
            raise RendezvousConfigError(f"rdzv-conf handler: must be lease, got {self.handler!r}")
        if not self.key_prefix.startswith("/") or " " in self.key_prefix:
            raise RendezvousConfigError(
                f"rdzv-conf key_prefix: must be an absolute path like /a/b, got {self.key_prefix!r}"
            )
        try:
            check_security(self)
        except ValueError as exc:
            raise RendezvousConfigError(f"rdzv-conf {exc}") from exc

    def for_endpoint(self, endpoint: str, run_id: str) -> RendezvousSettings:
        """These settings for the etcd at ``endpoint`` and the run ``run_id`` (a launcher knows
        both only once its embedded etcd is up and its run id derived).

        Raises:
            RendezvousConfigError: a malformed endpoint or an empty run id.
        """
        try:
            endpoints = parse_endpoints(endpoint)
        except ValueError as exc:
            raise RendezvousConfigError(str(exc)) from exc
        return dataclasses.replace(self, endpoints=endpoints, run_id=run_id)

    @property
    def run_prefix(self) -> str:
        """The etcd prefix of this run: ``{key_prefix}/{run_id}``."""
        return f"{self.key_prefix.rstrip('/')}/{self.run_id}"

    def client_config(self) -> EtcdClientConfig:
        """The etcd connection settings.

        Raises:
            RendezvousConfigError: no endpoint was given.
        """
        if not self.endpoints:
            raise RendezvousConfigError(
                "rdzv endpoint: none given (--rdzv-endpoint HOST:PORT[,HOST:PORT])"
            )
        return EtcdClientConfig(
            endpoints=self.endpoints,
            read_timeout=self.read_timeout,
            retry_timeout=self.retry_timeout,
            protocol=self.protocol,
            ca_cert=self.ca_cert,
            ssl_cert=self.ssl_cert,
            ssl_cert_key=self.ssl_cert_key,
            user=self.user,
            password=self.password,
        )


def parse_conf(conf: Mapping[str, object]) -> dict[str, Any]:
    """Check and type the ``--rdzv-conf`` keys of ``conf``: the :class:`RendezvousSettings`
    fields they set (``password_file`` read into ``password``).

    Raises:
        RendezvousConfigError: an unknown key, a malformed value, an unreadable password file.
    """
    for name in conf:
        if name not in KEYS_BY_NAME:
            raise RendezvousConfigError(unknown_key_message(name))
    values: dict[str, Any] = {}
    for key in _FIELD_KEYS:
        raw = conf.get(key.name)
        if raw is not None:
            values[key.name] = key.parse(key.name, raw)
    password_file = optional_text("password_file", conf.get("password_file") or "")
    if password_file:
        if values.get("password") is not None:
            raise RendezvousConfigError(
                "rdzv-conf password: give password or password_file, not both"
            )
        try:
            values["password"] = read_secret_file(password_file, key="rdzv-conf password_file")
        except ValueError as exc:
            raise RendezvousConfigError(str(exc)) from exc
    return values


def parse_settings(params: RendezvousParameters) -> RendezvousSettings:
    """The settings of torchrun's rendezvous parameters (``--rdzv-endpoint``, ``--rdzv-id``,
    ``--nnodes``, ``--local-addr``, ``--rdzv-conf``).

    An empty endpoint is accepted here (a launcher may check its settings before it starts an
    embedded etcd) and refused by :meth:`RendezvousSettings.client_config`.

    Raises:
        RendezvousConfigError: anything malformed; the one-line message names it.
    """
    return settings_from_conf(
        params.config,
        endpoint=str(params.endpoint or ""),
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
    )


def settings_from_conf(
    conf: str | Mapping[str, object],
    *,
    endpoint: str = "",
    run_id: str = "check",
    min_nodes: int = 1,
    max_nodes: int = 1,
    local_addr: str | None = None,
) -> RendezvousSettings:
    """The settings of an ``--rdzv-conf`` string or dict (a launcher's check before it starts).

    Raises:
        RendezvousConfigError: anything malformed; the one-line message names it.
    """
    text = conf if isinstance(conf, str) else ",".join(f"{k}={v}" for k, v in conf.items())
    values = parse_conf(parse_conf_string(conf) if isinstance(conf, str) else conf)
    try:
        endpoints = parse_endpoints(endpoint) if endpoint.strip() else ()
    except ValueError as exc:
        raise RendezvousConfigError(str(exc)) from exc
    return RendezvousSettings(
        run_id=run_id,
        endpoints=endpoints,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_addr=local_addr,
        conf=text,
        **values,
    )
