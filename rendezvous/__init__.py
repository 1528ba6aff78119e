"""An etcd v3 rendezvous backend for torchrun (``--rdzv-backend=etcd-v3``).

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=job1 \\
             --nnodes=1:2 --nproc-per-node=2 train.py

``create_backend(params)`` returns ``(backend, store)`` like torch's own backends;
``create_handler(params)`` returns the handler torchrun uses.

Names are imported lazily: importing torch's rendezvous package loads this package's torchrun
plugin, so eager imports here would be circular.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Endpoint": "rendezvous.etcd_client",
    "EtcdClientConfig": "rendezvous.etcd_client",
    "EtcdConnection": "rendezvous.etcd_client",
    "parse_endpoints": "rendezvous.etcd_client",
    "EtcdV3RendezvousBackend": "rendezvous.etcd_backend",
    "create_backend": "rendezvous.etcd_backend",
    "EtcdV3Store": "rendezvous.etcd_store",
    "EtcdV3RendezvousHandler": "rendezvous.handler",
    "create_handler": "rendezvous.handler",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rendezvous' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
