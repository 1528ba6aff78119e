"""The ``etcd-v3`` rendezvous handler and its torchrun plugin.

``torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:2379 --nnodes=MIN:MAX ...`` reaches
:func:`create_handler` through the ``torchrun.handlers`` entry point (:mod:`rendezvous.plugin`).

The handler is torch's ``DynamicRendezvousHandler`` over :class:`EtcdV3RendezvousBackend`, with
one correction. torch 2.13's handler shares one TCPStore, hosted by the rank-0 agent, with the
workers, and caches it across rounds: it rebuilds the cached ``MASTER_ADDR``/``MASTER_PORT`` only
when ``rank == 0`` and no server exists yet. Workers, in turn, assume "a new TCPStore for every
retry" (``torch.distributed.rendezvous._create_c10d_store``) and add no per-attempt prefix. After
a restart the new workers therefore meet the keys that the dead workers left in that store (gloo
rank addresses among them) and block in ``connectFullMesh``; a newcomer reads the address from a
round prefix the old rank 0 never wrote to, and waits forever. Our handler forgets the cached
store at the start of every round, so rank 0 creates a fresh TCPStore and publishes its address
under the new round's prefix each time -- exactly the fresh-store-per-round contract the workers
rely on.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from rendezvous.etcd_backend import create_backend

log = logging.getLogger(__name__)


class EtcdV3RendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous over etcd v3, with a fresh worker store every round."""

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        # Drop the previous round's shared TCPStore (its server stops once unreferenced) so that
        # the base class creates and publishes a new one for this round.
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        return super().next_rendezvous()


def _timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    try:
        seconds = params.get_as_int(f"{key}_timeout")
    except ValueError:
        raise ValueError(f"rdzv-conf {key}_timeout: {params.get(key + '_timeout')!r} is not an integer") from None
    if seconds is None:
        return None
    if seconds <= 0:
        raise ValueError(f"rdzv-conf {key}_timeout: must be > 0 seconds, got {seconds}")
    return timedelta(seconds=seconds)


HANDLERS = ("lease", "dynamic")


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the ``etcd-v3`` handler from torchrun's rendezvous parameters.

    ``--rdzv-conf handler=lease`` (the default) gives the native lease/watch handler of
    :mod:`rendezvous.lease_handler` (fast recovery; keys ``join_timeout`` 600,
    ``last_call_timeout`` 30 -- first round only --, ``lease_ttl`` 10). ``handler=dynamic`` gives
    torch's dynamic rendezvous over :class:`EtcdV3RendezvousBackend` (keys ``join_timeout``,
    ``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout``, ``keep_alive_interval``,
    ``keep_alive_max_attempt``). Both accept the connection keys of
    :func:`rendezvous.etcd_backend.create_backend`.
    """
    kind = str(params.get("handler", "lease")).strip().lower()
    if kind == "lease":
        from rendezvous.lease_handler import create_lease_handler

        return create_lease_handler(params)
    if kind != "dynamic":
        raise ValueError(f"rdzv-conf handler: must be one of {', '.join(HANDLERS)}, got {kind!r}")
    return create_dynamic_handler(params)


def create_dynamic_handler(params: RendezvousParameters) -> EtcdV3RendezvousHandler:
    """torch's dynamic rendezvous over etcd v3 (``--rdzv-conf handler=dynamic``)."""
    backend, store = create_backend(params)
    timeout = RendezvousTimeout(
        _timeout(params, "join"),
        _timeout(params, "last_call"),
        _timeout(params, "close"),
        _timeout(params, "heartbeat"),
    )
    keep_alive_interval = params.get_as_int("keep_alive_interval", 5)
    keep_alive_max_attempt = params.get_as_int("keep_alive_max_attempt", 3)
    if not keep_alive_interval or keep_alive_interval <= 0:
        raise ValueError(f"rdzv-conf keep_alive_interval: must be > 0, got {keep_alive_interval}")
    if not keep_alive_max_attempt or keep_alive_max_attempt <= 0:
        raise ValueError(f"rdzv-conf keep_alive_max_attempt: must be > 0, got {keep_alive_max_attempt}")
    return EtcdV3RendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=keep_alive_interval,
        keep_alive_max_attempt=keep_alive_max_attempt,
    )
