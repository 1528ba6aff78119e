"""Waits on collectives that an abort ends at once, even where gloo leaves the collective blocked.

gloo in torch 2.13 can leave a collective blocked after its connections are gone: a send whose
bytes were still queued in the connection's transmit queue when the connection failed is never
told (gloo's tcp ``Pair::signalException`` notifies the bound buffers of that queue, not the
unbound ones collectives use), so its gloo thread waits out the group's timeout, 30 minutes here.
Found by the chaos suite: a survivor's training thread sat in DDP's ``finalize_backward`` on a
gradient bucket whose ring allreduce had a large send queued when the group was aborted.

So while healing in place the training thread waits on the runtime's own gloo futures (the step
control, a state transfer; DDP's buckets only with the opt-in hooks of
:mod:`elastic_trainer.runtime.comms`) through the healer's :class:`AbortableWaits`
(:meth:`AbortableWaits.track`), which returns a future of its own, completed from the original
(one callback, on gloo's thread). :meth:`AbortableWaits.abort`
(the healer, when a heal round opens) fails every tracked future still pending, and every one
tracked after it until :meth:`AbortableWaits.reset` (the backward pass goes on launching buckets
after an abort), so the training thread raises and heals; a blocked gloo thread is left behind with its group, which is then kept
alive rather than destructed (its destructor would join that thread; see
``heal/group.py``). Off (``enabled`` False, without in-place healing), :meth:`track` returns the
future it is given and costs one attribute read. A bucket wait that nothing tracks (the default:
no Python on DDP's per-bucket path) is ended by the healer's stop watch instead
(``docs/design/heal-in-place.md``).

There is no process-wide instance: the healer owns one and hands it to whoever waits
(:class:`elastic_trainer.runtime.comms.WorkerComms`).

Invariant: a tracked future is completed exactly once, under one lock: by its collective, or by
an abort, whichever comes first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from elastic_trainer.runtime.failures import (
    ABORT_MARKER,  # in every error an abort sets: a group failure
)


class AbortableWaits:
    """The pending tracked futures of one process (see the module docstring)."""

    def __init__(self, *, enabled: bool = False) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._pending: set[torch.futures.Future[Any]] = set()
        self._aborted: str | None = None  # why, until reset
        self.interrupted = 0
        """Waits ended by an abort since :meth:`reset` (their collectives may still be blocked)."""

    def track(
        self,
        future: torch.futures.Future[Any],
        then: Callable[[torch.futures.Future[Any]], Any] | None = None,
    ) -> torch.futures.Future[Any]:
        """A future completed as ``future`` is (with ``then(future)``'s value, as
        ``future.then(then)`` would be), or failed by :meth:`abort`, whichever comes first. One
        Python callback per tracked future, ``then`` included (a comm hook's per-bucket cost)."""
        if not self.enabled:
            return future.then(then) if then is not None else future
        mine: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            aborted = self._aborted
            if aborted is not None:
                self.interrupted += 1
            else:
                self._pending.add(mine)
        if aborted is not None:
            mine.set_exception(RuntimeError(f"{ABORT_MARKER} ({aborted})"))
            return mine
        future.add_done_callback(partial(self._complete, mine, then))
        return mine

    def _complete(
        self,
        mine: torch.futures.Future[Any],
        then: Callable[[torch.futures.Future[Any]], Any] | None,
        done: torch.futures.Future[Any],
    ) -> None:
        """(gloo's thread) the collective finished: pass its value (through ``then``) or error on,
        unless aborted. Whoever takes ``mine`` out of the pending set under the lock completes it,
        outside the lock (a future runs its callbacks inline)."""
        with self._lock:
            owned = mine in self._pending
            self._pending.discard(mine)
        if not owned:
            return  # aborted first
        try:
            value = then(done) if then is not None else done.value()
        except Exception as exc:  # noqa: BLE001 - handed to the waiter
            mine.set_exception(exc)
        else:
            mine.set_result(value)

    def abort(self, reason: str) -> int:
        """Fail every pending tracked future now, and every one tracked until :meth:`reset` (any
        thread); returns how many were pending."""
        with self._lock:
            self._aborted = self._aborted or reason
            pending, self._pending = self._pending, set()
            self.interrupted += len(pending)
        for future in pending:
            future.set_exception(RuntimeError(f"{ABORT_MARKER} ({reason})"))
        return len(pending)

    def reset(self) -> int:
        """A new group: forget the old one's; returns how many of its waits an abort ended."""
        with self._lock:
            interrupted, self.interrupted = self.interrupted, 0
            self._pending.clear()
            self._aborted = None
        return interrupted
