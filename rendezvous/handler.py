"""The ``etcd-v3`` rendezvous handler and its torchrun plugin.

``torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:2379 --nnodes=MIN:MAX ...`` reaches
:func:`create_handler` through the ``torchrun.handlers`` entry point (:mod:`rendezvous.plugin`).
The handler is the lease/watch handler of :mod:`rendezvous.lease_handler`; before a node touches
the rendezvous, :func:`rendezvous.job_identity.claim_run` checks that the run id is not held by
another job.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousParameters

from rendezvous.conf_keys import conf_keys_table
from rendezvous.lease_handler import LeaseRendezvousHandler, create_lease_handler
from rendezvous.settings import parse_settings

__all__ = ["create_handler"]


def create_handler(params: RendezvousParameters) -> LeaseRendezvousHandler:
    """Create the ``etcd-v3`` handler from torchrun's rendezvous parameters.

    The endpoint is ``host:port`` or a comma-separated list of the members of one etcd cluster
    (``--rdzv-endpoint=etcd-0:2379,etcd-1:2379,etcd-2:2379``); requests fail over between them.
    The ``--rdzv-conf`` keys (:data:`rendezvous.settings.KEYS`)::

        %(keys)s

    Raises:
        RendezvousConfigError: a malformed parameter (before any connection is made).
        RendezvousConnectionError: etcd cannot be reached within ``retry_timeout`` seconds or
            refuses the credentials.
        RunIdInUseError: another job holds the run id (this node has touched nothing).
    """
    return create_lease_handler(parse_settings(params))


if create_handler.__doc__:  # the key table, generated from the one in rendezvous.conf_keys
    create_handler.__doc__ %= {"keys": conf_keys_table().replace("\n", "\n        ")}
