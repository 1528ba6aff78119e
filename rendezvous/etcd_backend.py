"""torch's ``RendezvousBackend`` over etcd v3.

The rendezvous state is one etcd key, ``{key_prefix}/{run_id}/state``. Its token is the key's
``mod_revision``: ``set_state`` is a single etcd transaction that writes only if the revision is
still the one the caller read (or, with no token, only if the key does not exist), and otherwise
returns what is there. A retried write therefore can never apply twice: the retry's comparison
fails against the revision the first attempt produced, and the caller gets the current state.

The value is framed as ``MAGIC | sha256(state) | state`` so that a corrupt or foreign value raises
``RendezvousStateError`` instead of being handed to the rendezvous as garbage. The key is attached
to an etcd lease of ``ttl`` seconds (two hours by default, like torch's etcd-v2 backend) that every
write renews, so abandoned runs clean themselves up.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from rendezvous.etcd_client import (
    EtcdClientConfig,
    EtcdConnection,
    parse_endpoints,
    read_secret_file,
)
from rendezvous.etcd_store import EtcdV3Store
from rendezvous.leases import RenewedLease

log = logging.getLogger(__name__)

_MAGIC = b"ETv3"
_DIGEST_SIZE = hashlib.sha256().digest_size
DEFAULT_KEY_PREFIX = "/elastic-trainer/rdzv"
DEFAULT_TTL = 7200


def frame_state(state: bytes) -> bytes:
    """Prefix ``state`` with a magic and its sha256."""
    return _MAGIC + hashlib.sha256(state).digest() + state


def unframe_state(value: bytes, *, key: str) -> bytes:
    """Return the state inside a framed value.

    Raises:
        RendezvousStateError: the value is not ours or its checksum does not match.
    """
    header = len(_MAGIC) + _DIGEST_SIZE
    if len(value) < header or not value.startswith(_MAGIC):
        raise RendezvousStateError(f"the rendezvous state at {key} is not an etcd-v3 state (corrupt or foreign)")
    digest, state = value[len(_MAGIC) : header], value[header:]
    if hashlib.sha256(state).digest() != digest:
        raise RendezvousStateError(f"the rendezvous state at {key} is corrupt (checksum mismatch)")
    return state


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Represents an etcd v3 based rendezvous backend.

    Args:
        connection: the connection to the etcd cluster.
        run_id: the run id of the rendezvous.
        key_prefix: the path under which run ids are kept.
        ttl: seconds an untouched state lives; defaults to two hours.
    """

    def __init__(
        self,
        connection: EtcdConnection,
        run_id: str,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        ttl: int | None = None,
    ) -> None:
        if not run_id:
            raise ValueError("run_id: the run id must be a non-empty string")
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl: must be a positive number of seconds, got {ttl}")
        self._connection = connection
        self._key = f"{key_prefix.rstrip('/')}/{run_id}/state"
        self._lease = RenewedLease(connection, ttl or DEFAULT_TTL)

    @property
    def name(self) -> str:
        """See base class."""
        return "etcd-v3"

    @property
    def key(self) -> str:
        """The etcd key that holds the state."""
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        value, meta = self._connection.call(lambda c: c.get(self._key), what="a state read")
        if value is None:
            return None
        return unframe_state(value, key=self._key), meta.mod_revision

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        if token is not None:
            try:
                revision = int(token)
            except (TypeError, ValueError):
                return self._current_state_not_set()
            if revision <= 0:
                return self._current_state_not_set()
        else:
            revision = 0  # create_revision == 0 means "the key does not exist"

        lease_id = self._lease.lease_id()
        framed = frame_state(state)
        txn = self._connection.etcd3.transactions
        key = self._key
        compare = (
            [txn.Mod(key) == revision] if revision else [txn.Create(key) == 0]
        )

        def attempt(client: Any) -> tuple[bool, Any]:
            return client.transaction(  # type: ignore[no-any-return]
                compare=compare,
                success=[txn.Put(key, framed, lease=lease_id)],
                failure=[txn.Get(key)],
            )

        succeeded, responses = self._connection.call(attempt, what="a state write")
        if succeeded:
            return state, responses[0].response_put.header.revision, True
        current = responses[0] if responses else []
        if not current:
            return None
        value, meta = current[0]
        return unframe_state(value, key=key), meta.mod_revision, False

    def _current_state_not_set(self) -> tuple[bytes, Token, bool] | None:
        result = self.get_state()
        return None if result is None else (*result, False)


def _params_get_float(params: RendezvousParameters, key: str, default: float) -> float:
    value = params.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv-conf {key}: {value!r} is not a number") from None
    if not number > 0:
        raise ValueError(f"rdzv-conf {key}: must be > 0, got {value!r}")
    return number


def client_config_from_params(params: RendezvousParameters) -> EtcdClientConfig:
    """Build the etcd client configuration from ``--rdzv-endpoint`` and ``--rdzv-conf``.

    Raises:
        ValueError: a value is malformed; the message names the key.
    """
    password = params.get("password")
    password_file = params.get("password_file")
    if password is not None and password_file:
        raise ValueError("rdzv-conf password: give password or password_file, not both")
    if password_file:
        password = read_secret_file(str(password_file), key="rdzv-conf password_file")
    protocol = str(params.get("protocol", "http")).strip().lower()
    try:
        return EtcdClientConfig(
            endpoints=parse_endpoints(params.endpoint),
            read_timeout=_params_get_float(params, "read_timeout", 10.0),
            retry_timeout=_params_get_float(params, "retry_timeout", 20.0),
            protocol=protocol,
            ca_cert=params.get("ca_cert") or None,
            ssl_cert=params.get("ssl_cert") or None,
            ssl_cert_key=params.get("ssl_cert_key") or None,
            user=params.get("user") or None,
            password=password,
        )
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("rdzv") else f"rdzv-conf {message}") from exc


def key_prefix_from_params(params: RendezvousParameters) -> str:
    """The ``key_prefix`` rdzv-conf value (default :data:`DEFAULT_KEY_PREFIX`), checked.

    Raises:
        ValueError: it is not an absolute path without spaces.
    """
    key_prefix = str(params.get("key_prefix", DEFAULT_KEY_PREFIX)).strip()
    if not key_prefix.startswith("/") or " " in key_prefix:
        raise ValueError(f"rdzv-conf key_prefix: must be an absolute path like /a/b, got {key_prefix!r}")
    return key_prefix


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, Store]:
    """Create a new :py:class:`EtcdV3RendezvousBackend` and its store from ``params``.

    The endpoint is ``host:port`` or a comma-separated list of the members of one etcd cluster
    (``--rdzv-endpoint=etcd-0:2379,etcd-1:2379,etcd-2:2379``); requests fail over between them.

    +---------------+--------------------------------------------------------------------------+
    | rdzv-conf key | Description                                                              |
    +===============+==========================================================================+
    | read_timeout  | gRPC deadline of one etcd request, seconds. Default 10.                  |
    +---------------+--------------------------------------------------------------------------+
    | retry_timeout | Total time transient faults are retried before giving up, seconds.       |
    |               | Default 20 (below the rendezvous timeouts). Bounds an unreachable etcd.  |
    +---------------+--------------------------------------------------------------------------+
    | protocol      | ``http`` (default) or ``https``.                                         |
    +---------------+--------------------------------------------------------------------------+
    | ca_cert       | CA certificate (PEM) of the etcd servers. Requires ``https``.            |
    +---------------+--------------------------------------------------------------------------+
    | ssl_cert      | Client certificate (PEM) for mutual TLS; with ``ssl_cert_key``.          |
    +---------------+--------------------------------------------------------------------------+
    | ssl_cert_key  | Private key (PEM) of ``ssl_cert``.                                       |
    +---------------+--------------------------------------------------------------------------+
    | user          | etcd user, when etcd auth is on; with ``password`` or ``password_file``. |
    +---------------+--------------------------------------------------------------------------+
    | password      | The user's password. Prefer ``password_file``.                           |
    +---------------+--------------------------------------------------------------------------+
    | password_file | File holding the password (a mounted Kubernetes Secret).                 |
    +---------------+--------------------------------------------------------------------------+
    | key_prefix    | etcd key prefix of all runs. Default ``/elastic-trainer/rdzv``.          |
    +---------------+--------------------------------------------------------------------------+
    | ttl           | Seconds an untouched rendezvous state lives (etcd lease). Default 7200.  |
    +---------------+--------------------------------------------------------------------------+

    Raises:
        ValueError: a parameter is malformed (the message names it).
        RendezvousConnectionError: etcd cannot be reached within ``retry_timeout`` seconds or
            refuses the credentials.
    """
    config = client_config_from_params(params)
    key_prefix = key_prefix_from_params(params)
    try:
        ttl = params.get_as_int("ttl", DEFAULT_TTL)
    except ValueError:
        raise ValueError(f"rdzv-conf ttl: {params.get('ttl')!r} is not an integer") from None
    if ttl is None or ttl <= 0:
        raise ValueError(f"rdzv-conf ttl: must be a positive number of seconds, got {ttl}")

    connection = EtcdConnection(config)
    connection.check()
    backend = EtcdV3RendezvousBackend(connection, params.run_id, key_prefix=key_prefix, ttl=ttl)
    store = EtcdV3Store(connection, f"{key_prefix.rstrip('/')}/{params.run_id}/store", ttl=ttl)
    return backend, store
