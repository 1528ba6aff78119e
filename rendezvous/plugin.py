"""The ``torchrun.handlers`` entry point of ``etcd-v3``.

Deliberately free of module-level imports: torch imports every ``torchrun.handlers`` plugin while
its own rendezvous package is still initialising, so this module must load without importing
torch, and the handler is imported only when torchrun actually creates one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

BACKEND_NAME = "etcd-v3"


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the ``etcd-v3`` handler (see :func:`rendezvous.handler.create_handler`)."""
    from rendezvous.handler import create_handler

    return create_handler(params)


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
