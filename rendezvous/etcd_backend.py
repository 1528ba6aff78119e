"""torch's ``RendezvousBackend`` over etcd v3.

The rendezvous state is one etcd key, ``{key_prefix}/{run_id}/state``. Its token is the key's
``mod_revision``: ``set_state`` is a single etcd transaction that writes only if the revision is
still the one the caller read (or, with no token, only if the key does not exist), and otherwise
returns what is there. A retried write therefore can never apply twice: the retry's comparison
fails against the revision the first attempt produced, and the caller gets the current state.

The value is framed (:mod:`rendezvous.framing`) so that a corrupt or foreign value raises
``RendezvousStateError`` instead of being handed to the rendezvous as garbage. The key is attached
to an etcd lease of ``ttl`` seconds (two hours by default, like torch's etcd-v2 backend) that every
write renews, so abandoned runs clean themselves up.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection
from rendezvous.etcd_store import EtcdV3Store
from rendezvous.framing import frame_state, unframe_state
from rendezvous.leases import RenewedLease
from rendezvous.settings import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_TTL,
    RendezvousSettings,
    conf_keys_table,
    parse_settings,
)

# Re-exported for callers that imported them from here.
__all__ = [
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_TTL",
    "EtcdV3RendezvousBackend",
    "client_config_from_params",
    "create_backend",
    "create_backend_from_settings",
    "frame_state",
    "key_prefix_from_params",
    "unframe_state",
]

log = logging.getLogger(__name__)


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

    @property
    def connection(self) -> EtcdConnection:
        """The connection to the etcd cluster."""
        return self._connection

    def lease_id(self) -> int:
        """The etcd lease the state is attached to (granted on first use, renewed lazily)."""
        return self._lease.lease_id()

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        value, meta = self._connection.call(
            lambda c: c.get(self._key), what="a state read", read=True
        )
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
        compare = [txn.Mod(key) == revision] if revision else [txn.Create(key) == 0]

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


def client_config_from_params(params: RendezvousParameters) -> EtcdClientConfig:
    """The etcd connection settings of torchrun's parameters (see :func:`parse_settings`).

    Raises:
        RendezvousConfigError: a value is malformed; the message names the key.
    """
    return parse_settings(params).client_config()


def key_prefix_from_params(params: RendezvousParameters) -> str:
    """The checked ``key_prefix`` of torchrun's parameters (see :func:`parse_settings`).

    Raises:
        RendezvousConfigError: a value is malformed; the message names the key.
    """
    return parse_settings(params).key_prefix


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, Store]:
    """Create a new :py:class:`EtcdV3RendezvousBackend` and its store from ``params``.

        The endpoint is ``host:port`` or a comma-separated list of the members of one etcd cluster
        (``--rdzv-endpoint=etcd-0:2379,etcd-1:2379,etcd-2:2379``); requests fail over between them.
        The ``--rdzv-conf`` keys (:data:`rendezvous.settings.KEYS`; the backend reads the connection
        keys, ``key_prefix`` and ``ttl``, the handlers the rest)::

    %(keys)s

        Raises:
            RendezvousConfigError: a parameter is malformed (the message names it).
            RendezvousConnectionError: etcd cannot be reached within ``retry_timeout`` seconds or
                refuses the credentials.
    """
    return create_backend_from_settings(parse_settings(params))


if create_backend.__doc__:  # the key table, generated from the one in rendezvous.settings
    create_backend.__doc__ %= {
        "keys": "\n".join("        " + line for line in conf_keys_table().splitlines())
    }


def create_backend_from_settings(
    settings: RendezvousSettings,
) -> tuple[EtcdV3RendezvousBackend, Store]:
    """:func:`create_backend` for parsed settings."""
    connection = EtcdConnection(settings.client_config())
    try:
        connection.check()
    except BaseException:
        connection.close()
        raise
    backend = EtcdV3RendezvousBackend(
        connection, settings.run_id, key_prefix=settings.key_prefix, ttl=settings.ttl
    )
    store = EtcdV3Store(connection, f"{settings.run_prefix}/store", ttl=settings.ttl)
    return backend, store
