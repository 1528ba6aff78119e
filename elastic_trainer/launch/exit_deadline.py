"""The launcher ends within a bound after its workers ended, whatever hangs in its clean-up.

    deadline = ExitDeadline(EXIT_BOUND_S)
    ...                      # torchrun's agent returned: the workers are gone
    deadline.arm(code)       # clean-up and interpreter exit from here on

Once armed, a daemon thread waits ``bound_s``; if the process still runs then, it writes one line
and every thread's stack to stderr and ends the process with ``os._exit(code)``. What it bounds:
the clean-up after the agent (the rendezvous leave, the progress publisher, etcd, the janitor,
each bounded on its own) and the interpreter's exit, where gRPC's or a TCPStore's teardown once
kept a torchrun agent alive for minutes after its workers finished (no cause was found; see
``docs/design/launcher.md``). Stdlib only.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

EXIT_BOUND_S = 10.0
"""Seconds from the agent's return (the workers are gone) until the launcher is ended anyway.
Every step of the clean-up has its own, shorter bound (the janitor's is the longest, 10 s, and it
only waits when processes remain); this one catches a hang that none of them covers."""

log = logging.getLogger(__name__)


class ExitDeadline:
    """See the module docstring."""

    def __init__(self, bound_s: float = EXIT_BOUND_S) -> None:
        if bound_s <= 0:
            raise ValueError(f"bound_s: must be positive, got {bound_s}")
        self.bound_s = bound_s
        self._thread: threading.Thread | None = None

    def arm(self, code: int) -> None:
        """Start counting (once; a second call does nothing): ``code`` is the exit status the
        process ends with if the bound passes."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._watch, args=(code,), name="exit-deadline", daemon=True
        )
        self._thread.start()

    def _watch(self, code: int) -> None:
        time.sleep(self.bound_s)
        log.error(
            "the launcher is still running %.0f s after its workers ended; exiting now with status %d "
            "(thread stacks follow)",
            self.bound_s,
            code,
        )
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        finally:
            os._exit(code)
