"""Leaving a training process without the C++ teardown that can abort it.

torch 2.13 with gloo occasionally aborts during interpreter teardown, after a clean
``destroy_process_group`` (``terminate called without an active exception``, SIGABRT, exit -6).
A worker that finished its job then looks *failed* to torchrun's agent, which restarts the whole
finished group; a worker that failed with a clear error code gets a crash report instead. Seen
here in the chaos and torchrun tests; the cause is torch's, not ours.

:func:`exit_process` ends the process the way a normal interpreter exit would as far as Python
code can tell -- non-daemon threads joined, ``atexit`` handlers run (e.g. the metrics' last
flush), logging shut down, streams flushed -- and then leaves with ``os._exit``, skipping the
C++ static destructors. Entry points (the example, ``doctor``, warm-started workers) call it last.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """Run Python's exit work, then ``os._exit(code)``."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # what interpreter exit does first
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)
