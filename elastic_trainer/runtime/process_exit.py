"""Leaving a training process without the C++ teardown that can abort it.

torch 2.13 with gloo occasionally aborts (SIGABRT) in interpreter teardown after a clean
``destroy_process_group``, which makes a finished worker look failed. :func:`exit_process` does
Python's own exit work (threads, ``atexit``, logging, streams), then ``os._exit``. Entry points
call it last. Design: ``docs/design/graceful-stop.md``.
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
