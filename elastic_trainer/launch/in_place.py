"""The launcher's side of in-place healing: torchrun's agent becomes a local supervisor.

With ``--heal in_place`` (the default of ``elastic-trainer run``) the job's membership after its
first rendezvous is the workers' own (:mod:`elastic_trainer.heal`). The agent keeps what it is
good at -- starting this node's workers, watching them, the failure policy, the exit -- and
stops re-forming the whole job:

* the first ``next_rendezvous`` of a node that starts a new job is torchrun's (the ``etcd-v3``
  round, with its minimum and last call); every later one, and the first one of a node that joins
  a job already running, returns at once with a one-node placeholder and starts the node's
  workers as *joiners*: they join the running group in place and take the state from a peer;
* ``num_nodes_waiting()`` is 0: a new node or a lost one is the workers' business, not a reason
  to restart every worker of every node;
* each launcher holds a key ``nodes/<node>`` on a lease (``lease_ttl``): a job whose epoch names
  a node whose key lives is running, one whose nodes are all gone (a crashed earlier job with the
  same run id) is not.

Everything else (close, shutdown, run id, store) is the ``etcd-v3`` handler's.
Design: ``docs/design/heal-in-place.md``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from torch.distributed import HashStore, PrefixStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from elastic_trainer.heal.membership import HealKeys
from elastic_trainer.heal.protocol import Epoch, ProtocolError
from elastic_trainer.runtime.settings import (
    ENV_HEAL,
    ENV_HEAL_ENDPOINT,
    ENV_HEAL_JOIN,
    ENV_HEAL_RDZV_CONF,
    ENV_HEAL_WORLD,
    ENV_NODE,
)
from rendezvous import etcd_ops
from rendezvous.etcd_client import EtcdConnection
from rendezvous.lease_keeper import LeaseKeeper

log = logging.getLogger(__name__)

BACKEND_NAME = "elastic-trainer-in-place"
"""The rendezvous backend name ``elastic-trainer run`` gives torchrun when it heals in place."""


def node_key(keys: HealKeys, node: str) -> str:
    return f"{keys.prefix}nodes/{node}"


def running_epoch(connection: EtcdConnection, keys: HealKeys, *, own_node: str) -> Epoch | None:
    """The job's current epoch if the job is running: not finished, and at least one of its
    members' nodes (not this one) holds its key."""
    response = etcd_ops.get_range(connection, keys.prefix, prefix=True, what="reading the heal state")
    epoch, nodes = None, set()
    node_prefix = node_key(keys, "")
    for kv in response.kvs:
        key = kv.key.decode()
        if key == keys.epoch:
            try:
                epoch = Epoch.decode(bytes(kv.value))
            except ProtocolError as exc:
                log.warning("in-place: ignoring %s", exc)
        elif key.startswith(node_prefix):
            nodes.add(key[len(node_prefix):])
    if epoch is None or epoch.finished:
        return None
    member_nodes = {member.slot.rsplit("/", 1)[0] for member in epoch.members}
    return epoch if (member_nodes & nodes) - {own_node} else None


class InPlaceRendezvousHandler(RendezvousHandler):
    """Wraps the ``etcd-v3`` handler; see the module docstring."""

    def __init__(self, inner: RendezvousHandler, connection: EtcdConnection, *, run_id: str, node: str,
                 lease_ttl: int) -> None:
        self._inner = inner
        self._connection = connection
        self._keys = HealKeys.of(run_id)
        self._node = node
        self._formed_once = False
        self._lease_id = int(connection.call(lambda client: client.lease(lease_ttl), what="a lease grant").id)
        etcd_ops.put_key(connection, node_key(self._keys, node), node.encode(), lease=self._lease_id,
                         what="registering this node")
        LeaseKeeper.of(connection).keep(self._lease_id, lease_ttl, lambda _lease: self._register_again(lease_ttl))

    def _register_again(self, lease_ttl: int) -> None:
        log.warning("in-place: this node's lease expired (etcd unreachable for %d s); registering again", lease_ttl)
        try:
            self._lease_id = int(self._connection.call(lambda c: c.lease(lease_ttl), what="a lease grant").id)
            etcd_ops.put_key(self._connection, node_key(self._keys, self._node), self._node.encode(),
                             lease=self._lease_id, what="registering this node")
            LeaseKeeper.of(self._connection).keep(self._lease_id, lease_ttl,
                                                  lambda _lease: self._register_again(lease_ttl))
        except Exception as exc:  # noqa: BLE001 - retried at the next expiry; joins still work
            log.warning("in-place: registering again failed: %s", exc)

    # -- RendezvousHandler ---------------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND_NAME  # torch checks the handler's name against the requested backend

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def next_rendezvous(self) -> RendezvousInfo:
        running = None if self._formed_once else running_epoch(self._connection, self._keys, own_node=self._node)
        if self._formed_once or running is not None:
            os.environ[ENV_HEAL_JOIN] = "1"
            if running is not None:
                log.warning("in-place: job %s is running (epoch %d, %d workers); this node's workers join it in place",
                            self.get_run_id(), running.number, running.world_size)
            else:
                log.warning("in-place: this node's workers restart and join the running job in place")
            self._formed_once = True
            # torchrun needs a rank and a store for its own bookkeeping; the workers ignore both.
            store = PrefixStore("in-place-placeholder", HashStore())
            return RendezvousInfo(store, 0, 1, RendezvousStoreInfo("127.0.0.1", 0))
        os.environ[ENV_HEAL_JOIN] = "0"
        info = self._inner.next_rendezvous()
        self._formed_once = True
        return info

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return 0

    def shutdown(self) -> bool:
        self._leave()
        return self._inner.shutdown()

    def _leave(self) -> None:
        LeaseKeeper.of(self._connection).forget(self._lease_id)
        try:
            self._connection.call(lambda client: client.revoke_lease(self._lease_id), what="a lease revoke",
                                  retry_timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            log.debug("in-place: revoking this node's lease failed: %s", exc)


def register_backend(*, node: str) -> None:
    """Register :data:`BACKEND_NAME` with torch: the ``etcd-v3`` handler, wrapped."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from rendezvous.plugin import create_rdzv_handler
    from rendezvous.settings import parse_settings

    def create(params: RendezvousParameters) -> RendezvousHandler:
        inner = create_rdzv_handler(params)
        settings = parse_settings(params)
        connection = EtcdConnection(settings.client_config())
        return InPlaceRendezvousHandler(inner, connection, run_id=params.run_id, node=node,
                                        lease_ttl=int(settings.lease_ttl))

    registry: Any = rendezvous_handler_registry
    if registry._registry.get(BACKEND_NAME) is None:
        registry.register(BACKEND_NAME, create)


def worker_environment(*, endpoint: str, rdzv_conf: str, node: str, min_world: int, max_world: int) -> Mapping[str, str]:
    """What the workers of a node that heals in place need to know."""
    return {ENV_HEAL: "in_place", ENV_HEAL_ENDPOINT: endpoint, ENV_HEAL_RDZV_CONF: rdzv_conf, ENV_NODE: node,
            ENV_HEAL_WORLD: f"{min_world}:{max_world}", ENV_HEAL_JOIN: "0"}
