"""The ``torchrun.handlers`` entry point of ``etcd-v3``.

Deliberately free of module-level torch imports: torch imports every ``torchrun.handlers`` plugin while
its own rendezvous package is still initialising, so this module must load without importing
torch, and the handler is imported only when torchrun actually creates one.

torchrun creates the handler before its agent starts and outside the ``try`` that would shut a
rendezvous down, so a mistake found here (a bad ``--rdzv-conf``, an unreachable etcd, a run id
held by another job) ends the process with one line on stderr and exit status 2, no traceback,
and nothing of a running job touched.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

BACKEND_NAME = "etcd-v3"

WORKER_ENV_BACKEND = "ELASTIC_TRAINER_RDZV_BACKEND"
"""Set to ``etcd-v3`` in the agent's environment, which its workers inherit: their store is a new
one every round (``elastic_trainer/runtime/distributed.py`` warns when torch's c10d shares one)."""
WORKER_ENV_ENDPOINT = "ELASTIC_TRAINER_HEAL_ENDPOINT"
"""The job's etcd endpoint(s), for the workers' own etcd use (in-place healing, the diagnostics
endpoints' registry); set in the agent's environment unless the launcher set it."""
WORKER_ENV_CONF = "ELASTIC_TRAINER_HEAL_RDZV_CONF"
"""The job's ``--rdzv-conf`` text (etcd TLS and auth: a password stays a file name), likewise."""


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the ``etcd-v3`` handler (see :func:`rendezvous.handler.create_handler`).

    Raises:
        SystemExit: (status 2) after printing ``etcd-v3: error: <one line>`` to stderr, for a
            bad setting, an unreachable etcd, or a run id held by another job.
    """
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from rendezvous.handler import create_handler
    from rendezvous.job_identity import RunIdInUseError
    from rendezvous.settings import RendezvousConfigError

    try:
        handler = create_handler(params)
    except (RendezvousConfigError, RendezvousConnectionError, RunIdInUseError) as exc:
        print(f"{BACKEND_NAME}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    os.environ[WORKER_ENV_BACKEND] = BACKEND_NAME
    settings = handler.settings
    os.environ.setdefault(WORKER_ENV_ENDPOINT, ",".join(map(str, settings.endpoints)))
    if settings.conf:
        os.environ.setdefault(WORKER_ENV_CONF, settings.conf)
    return handler


def torchrun_plugin() -> Any:
    """Entry point of the ``torchrun.handlers`` group: returns the handler factory."""
    return create_rdzv_handler


def ensure_registered() -> None:
    """Make sure torch's handler registry knows ``etcd-v3``; raise if the plugin failed to load.

    torch only logs a warning when a plugin fails to register; our own tooling calls this so that
    such a failure stops the launch with a clear message instead.

    Raises:
        RuntimeError: the backend is registered under another factory or not at all.
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    registry: Any = rendezvous_handler_registry
    if registry._registry.get(BACKEND_NAME) is None:
        registry.register(BACKEND_NAME, create_rdzv_handler)
    if registry._registry.get(BACKEND_NAME) is not create_rdzv_handler:
        raise RuntimeError(
            f"the '{BACKEND_NAME}' rendezvous backend is registered by another package "
            f"({registry._registry.get(BACKEND_NAME)!r}); uninstall the conflicting plugin"
        )
