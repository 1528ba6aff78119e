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

Before a node touches the rendezvous, :func:`rendezvous.job_identity.claim_run` checks that the
run id is not held by another job (both handlers).
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

from rendezvous.etcd_backend import create_backend_from_settings
from rendezvous.job_identity import claim_run, current_job_identity
from rendezvous.lease_handler import create_lease_handler
from rendezvous.settings import HANDLERS, RendezvousSettings, parse_settings

__all__ = ["HANDLERS", "EtcdV3RendezvousHandler", "create_dynamic_handler", "create_handler"]

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


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the ``etcd-v3`` handler from torchrun's rendezvous parameters.

    ``--rdzv-conf handler=lease`` (the default) gives the native lease/watch handler of
    :mod:`rendezvous.lease_handler`; ``handler=dynamic`` gives torch's dynamic rendezvous over
    :class:`rendezvous.etcd_backend.EtcdV3RendezvousBackend`. Keys: :data:`rendezvous.settings.KEYS`.

    Raises:
        RendezvousConfigError: a malformed parameter (before any connection is made).
        RendezvousConnectionError: etcd cannot be reached.
        RunIdInUseError: another job holds the run id (this node has touched nothing).
    """
    settings = parse_settings(params)
    if settings.handler == "lease":
        return create_lease_handler(settings)
    return create_dynamic_handler(settings)


def create_dynamic_handler(settings: RendezvousSettings) -> EtcdV3RendezvousHandler:
    """torch's dynamic rendezvous over etcd v3 (``--rdzv-conf handler=dynamic``)."""
    backend, store = create_backend_from_settings(settings)
    identity = current_job_identity()
    if identity is not None:  # the job record lives as long as the run's state (same lease)
        try:
            claim_run(
                backend.connection,
                f"{settings.run_prefix}/job",
                identity,
                run_id=settings.run_id,
                lease=backend.lease_id(),
            )
        except BaseException:
            backend.connection.close()
            raise
    timeout = RendezvousTimeout(
        timedelta(seconds=settings.join_timeout),
        timedelta(seconds=settings.last_call_timeout),
        timedelta(seconds=settings.close_timeout),
        timedelta(seconds=settings.heartbeat_timeout),
    )
    return EtcdV3RendezvousHandler.from_backend(
        settings.run_id,
        store,
        backend,
        settings.min_nodes,
        settings.max_nodes,
        settings.local_addr,
        timeout,
        keep_alive_interval=settings.keep_alive_interval,
        keep_alive_max_attempt=settings.keep_alive_max_attempt,
    )
