"""The worker process of ``elastic-trainer run``: the user's script or module, run as ``__main__``.

    python -u -m elastic_trainer.train.worker_entry (-m MODULE | SCRIPT) [ARGS...]

torchrun starts this (directly, or forked by the warm-start server) instead of ``python -u
SCRIPT``. It runs the target exactly as ``python -m``/``python SCRIPT`` would (``runpy``), and an
uncaught failure -- a syntax error, a missing import, an exception, ``sys.exit(2)`` -- is
classified and recorded in torchrun's error file (:mod:`elastic_trainer.runtime.failures`) instead of
printing a traceback from every rank: the launcher prints the root cause once and decides whether
a restart can help. Before the target runs it starts the worker's heartbeat
(:mod:`elastic_trainer.runtime.heartbeat`; a no-op unless the launcher asked for one), so cold and
warm-forked workers alike are watched for freezing. Stdlib only until a failure happens.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Sequence

from elastic_trainer.runtime import failures, heartbeat
from elastic_trainer.runtime.exit_codes import EXIT_OK, EXIT_STOPPED
from elastic_trainer.runtime.process_exit import exit_process

PROG = "elastic-trainer worker"


def run_target(argv: Sequence[str]) -> int:
    """Run ``-m MODULE ARGS`` or ``SCRIPT ARGS`` as ``__main__``; return 0 (exceptions propagate)."""
    argv = list(argv)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(f"{PROG}: nothing to run (expected -m MODULE or SCRIPT)")
    if argv[0] == "-m":
        module = argv[1]
        sys.argv = [module, *argv[2:]]
        sys.path[0] = os.getcwd()
        sys.modules.pop(
            module, None
        )  # run fresh as __main__, as python -m does; its imports stay warm
        runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]  # what python -m runs
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    return 0


def exit_status(value: object) -> int:
    """The process status of ``sys.exit(value)``."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    with contextlib.suppress(BaseException):
        print(value, file=sys.stderr)
    return 1


def run(argv: Sequence[str]) -> int:
    """Run the target; classify and record an uncaught failure; return the exit status."""
    heartbeat.start_from_environ()
    try:
        return run_target(argv)
    except SystemExit as exc:
        code = exit_status(exc.code)
        if code not in (EXIT_OK, EXIT_STOPPED):  # a graceful stop after SIGTERM is not a failure
            failures.record(
                failures.report_of(exc), error_file=failures.ReportTarget.from_environ().error_file
            )
        return code
    except BaseException as exc:  # noqa: BLE001 - the worker's own uncaught error
        return failures.exit_after(exc, prog=PROG)


def main(argv: Sequence[str] | None = None) -> None:
    code = run(sys.argv[1:] if argv is None else argv)
    # Python's exit work, then os._exit: torch's C++ teardown (gloo) occasionally aborts.
    exit_process(code)


if __name__ == "__main__":
    main()
