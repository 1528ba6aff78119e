"""gRPC's private parts, touched in this one module (grpcio 1.85; check on an upgrade).

gRPC's blocking waits in Python (the next response of a stream, a future's result) wait on a
condition in slices of ``grpc._common.MAXIMUM_WAIT_TIMEOUT`` (0.1 s), so that a signal handler of
a main thread blocked there runs within 0.1 s (grpc/grpc#19464). This package reads its streams
(the watch hub's, the lease keeper's) on threads of their own, never on a main thread, and there
the slices are ten wake-ups a second per stream for nothing: in a training worker each one takes
the GIL from the training thread, in the launcher each one takes a core from the workers for a
moment. :func:`quiet_stream_waits` makes the slice 1 s. What it costs: a main thread that waits
on a gRPC stream or future of its own runs a signal handler up to 1 s late (unary calls are not
affected: they wait in gRPC's Cython loop, which checks for signals itself). Measured in
``docs/design/startup-and-threads.md``.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

STREAM_WAIT_SLICE_S = 1.0
"""The slice gRPC's waits poll in once :func:`quiet_stream_waits` ran (gRPC's own: 0.1 s)."""


def quiet_stream_waits() -> None:
    """Make gRPC's Python-level waits poll every :data:`STREAM_WAIT_SLICE_S` (idempotent; never
    shortens a slice that is already longer). Does nothing, with a debug line, where a gRPC
    release has no such knob."""
    try:
        from grpc import _common
    except ImportError:  # pragma: no cover - every grpcio we support has it
        log.debug("grpc._common is gone: gRPC's waits keep their own slice")
        return
    current = getattr(_common, "MAXIMUM_WAIT_TIMEOUT", None)
    if not isinstance(current, int | float):
        log.debug("grpc._common.MAXIMUM_WAIT_TIMEOUT is gone: gRPC's waits keep their own slice")
        return
    if current < STREAM_WAIT_SLICE_S:
        _common.MAXIMUM_WAIT_TIMEOUT = STREAM_WAIT_SLICE_S
