"""An etcd v3 rendezvous backend for torchrun (``--rdzv-backend=etcd-v3``).

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=job1 \\
             --nnodes=1:2 --nproc-per-node=2 train.py

``create_handler(params)`` returns the handler torchrun uses; ``parse_settings(params)`` reads
the ``--rdzv-conf`` keys (:mod:`rendezvous.settings`); ``set_job_identity`` declares what this
process's job runs, so that another job is refused its run id (:mod:`rendezvous.job_identity`).

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
    "EtcdV3Store": "rendezvous.etcd_store",
    "StoreTimeoutError": "rendezvous.etcd_store",
    "create_handler": "rendezvous.handler",
    "RendezvousConfigError": "rendezvous.settings",
    "RendezvousSettings": "rendezvous.settings",
    "parse_conf_string": "rendezvous.settings",
    "parse_settings": "rendezvous.settings",
    "settings_from_conf": "rendezvous.settings",
    "JobIdentity": "rendezvous.job_identity",
    "RunIdInUseError": "rendezvous.job_identity",
    "set_job_identity": "rendezvous.job_identity",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rendezvous' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
