"""The process group of a healing worker: created, aborted from any thread, created again.

gloo (torch 2.13) has no working abort: ``ProcessGroupGloo.abort()`` returns, but a collective
blocked on a peer that stopped answering stays blocked (measured: until the peer dies). What
does unblock it is the end of its connections, so :meth:`HealableGroup.abort` shuts down the
group's own TCP connections (``shutdown(2)``; never the listening socket, whose failure gloo
treats as fatal, and never a connection to etcd): every pending and later operation of that group
fails at once with gloo's "Connection closed by peer", and the group is then destroyed. The
group's sockets are the ones that appeared while it was created (the process's socket table
before and after). NCCL has a real abort (``ncclCommAbort``) and torch 2.13 exposes it as
``ProcessGroup.abort()``; that is what :meth:`abort` calls there.

A new group is created with torch's own ``init_process_group`` on a ``PrefixStore`` per epoch
over the job's etcd store: no rank hosts the store, so it survives the loss of any node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastic_trainer.runtime.abortable import AbortableWaits
from elastic_trainer.runtime.torch_compat import forget_unfinished_default_group

log = logging.getLogger(__name__)

KEEP_MARGIN_S = 60.0
"""A group kept after an abort is let go this long after its collectives' timeout."""


def socket_inodes() -> dict[int, int]:
    """This process's open sockets: file descriptor -> inode."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            info = os.stat(f"/proc/self/fd/{fd}")
        except (OSError, ValueError):
            continue
        if stat.S_ISSOCK(info.st_mode):
            found[fd] = info.st_ino
    return found


def shutdown_connections(
    sockets: dict[int, int], *, keep_ports: frozenset[int] = frozenset()
) -> int:
    """``shutdown(SHUT_RDWR)`` every connected TCP socket of ``sockets`` still open under the same
    inode (not listening, not to a port in ``keep_ports``); returns how many."""
    done = 0
    for fd, inode in sockets.items():
        try:
            if os.fstat(fd).st_ino != inode:
                continue  # closed, and the number reused
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (
                sock.family not in (socket.AF_INET, socket.AF_INET6)
                or sock.type != socket.SOCK_STREAM
            ):
                continue
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            try:
                peer_port = int(sock.getpeername()[1])
            except OSError:
                continue  # not connected
            if peer_port in keep_ports:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            continue
        finally:
            sock.close()  # the duplicate only
    return done


class HealableGroup:
    """The default process group of one worker, which can be aborted and created again.

    Args:
        backend: ``gloo`` or ``nccl``.
        timeout_s: the collective timeout of every group it creates.
        keep_ports: TCP ports never shut down by :meth:`abort` (etcd's).
        waits: the worker's abortable waits, failed and reset when a group is destroyed.
    """

    def __init__(
        self,
        backend: str,
        timeout_s: float,
        *,
        keep_ports: frozenset[int] = frozenset(),
        waits: AbortableWaits | None = None,
    ) -> None:
        self.backend = backend
        self.waits = waits if waits is not None else AbortableWaits()
        self.timeout_s = timeout_s
        self.keep_ports = keep_ports
        self._lock = threading.Lock()
        self._sockets: dict[int, int] = {}
        self._aborted = False
        self.generation = 0
        self._kept: list[Any] = []  # aborted groups whose blocked collectives outlive them

    @property
    def aborted(self) -> bool:
        return self._aborted

    def create(self, *, rank: int, world_size: int, store: Any | None = None) -> None:
        """Create the default group (``store=None``: from torchrun's environment)."""
        before = socket_inodes()
        kwargs: dict[str, Any] = {
            "backend": self.backend,
            "timeout": timedelta(seconds=self.timeout_s),
            "rank": rank,
            "world_size": world_size,
        }
        if store is not None:
            kwargs["store"] = store
        try:
            dist.init_process_group(**kwargs)
        except BaseException:
            forget_unfinished_default_group()  # the next attempt must name its group as fresh peers do
            raise
        self.adopt_new_sockets(before)
        with self._lock:
            self._aborted = False
            self.generation += 1

    def adopt_new_sockets(self, before: dict[int, int]) -> None:
        """Sockets opened since ``before`` belong to the group (a side group created later, too)."""
        after = socket_inodes()
        with self._lock:
            self._sockets.update(
                {fd: inode for fd, inode in after.items() if before.get(fd) != inode}
            )

    def abort(self) -> None:
        """Make every pending and later collective of the current group fail now (any thread)."""
        with self._lock:
            if self._aborted or not dist.is_initialized():
                return
            self._aborted = True
            sockets = dict(self._sockets)
        if self.backend == "nccl":
            try:
                dist.distributed_c10d._get_default_group().abort()
            except Exception as exc:  # noqa: BLE001 - best effort; destroy follows
                log.warning("heal: aborting the NCCL group failed: %s", exc)
            return
        closed = shutdown_connections(sockets, keep_ports=self.keep_ports)
        log.debug("heal: shut down %d connection(s) of the process group", closed)

    def destroy(self) -> None:
        """Abort and destroy the current group (never raises: it runs after a failure).

        A group with a collective that an abort had to interrupt (:mod:`elastic_trainer.runtime.abortable`)
        is unregistered but kept alive until its timeout has passed: its gloo thread may stay
        blocked until then, and the group's destructor would join that thread, on whichever
        thread let go of the group last (the training thread, in a garbage collection)."""
        self.abort()
        self.waits.abort("the process group is destroyed")
        interrupted = self.waits.reset()
        if dist.is_initialized():
            if interrupted:
                kept = dist.distributed_c10d._get_default_group()
                self._kept.append(kept)
                release = threading.Timer(
                    self.timeout_s + KEEP_MARGIN_S, self._release, args=(kept,)
                )
                release.daemon = True
                release.start()
                log.info(
                    "heal: %d collective(s) of the aborted group were interrupted; it is kept %.0f s, not "
                    "destructed now (%d kept)",
                    interrupted,
                    self.timeout_s + KEEP_MARGIN_S,
                    len(self._kept),
                )
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - the group is broken anyway
                log.warning("heal: destroying the broken process group failed: %s", exc)
        with self._lock:
            self._sockets = {}

    def _release(self, group: Any) -> None:
        """(Timer) the kept group's collectives have all timed out by now: let it go."""
        with contextlib.suppress(ValueError):
            self._kept.remove(group)
