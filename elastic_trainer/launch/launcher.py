"""``elastic-trainer run``: torchrun's own launcher over ``etcd-v3``, with an embedded etcd.

    elastic-trainer run --nnodes 1:2 --nproc-per-node 2 -m elastic_trainer.examples.synthetic_cnn

The agent, restarts and worker management are torch's (``torch.distributed.run``). This module
is the launch's edge: it starts the janitor and the warm server, has
:mod:`elastic_trainer.launch.plan` check everything a user can get wrong (without torch: a
mistake or ``--dry-run`` is answered in a fraction of a second), then hands the checked plan to
:mod:`elastic_trainer.launch.job`, which starts the embedded etcd, the node's metrics, the
failure policy, the frozen-worker watchdog and torch's agent. Everything is always cleaned up.
Design: ``docs/design/launcher.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import uuid

from elastic_trainer.launch.janitor import Janitor, sweep_stale
from elastic_trainer.launch.options import RunOptions
from elastic_trainer.launch.plan import (
    Target,
    dry_run_command,
    plan_launch,
    tell_workers,
)
from elastic_trainer.launch.warm_start import DEFAULT_PRELOAD, WarmStartServer, start_server
from elastic_trainer.runtime.settings import ENV_LAUNCHER_ID, LaunchContract

log = logging.getLogger(__name__)


EMBEDDED_LAST_CALL_S = 0.1
"""The first round's last call on this node's own embedded etcd (unless ``--last-call-timeout`` is
given): no other node can be there yet (it needs the endpoint this node prints once its etcd is
up), so waiting for one only delays the first step (5 s, issue 30); a later node joins in place.
The rendezvous settings want a positive value: 0.1 s."""


def for_embedded_etcd(options: RunOptions) -> RunOptions:
    """``options`` as a launch on its own embedded etcd runs them (see :data:`EMBEDDED_LAST_CALL_S`)."""
    if (
        options.rdzv_endpoint is not None
        or options.sources.get("last_call_timeout", "default") != "default"
    ):
        return options
    return dataclasses.replace(options, last_call_timeout=EMBEDDED_LAST_CALL_S)


def launch(options: RunOptions, target: Target, *, dry_run: bool = False) -> int:
    """Run the job; return the process exit code.

    Raises:
        UserError: anything the user can fix, detected before workers start.
    """
    try:
        return _launch_and_clean_up(options, target, dry_run=dry_run)
    except LauncherSignal as exc:
        # Everything started so far was stopped on the way out (the ExitStacks; the janitor
        # covers what a second signal interrupted): one line, the signal's exit status.
        log.warning(
            "stopped by %s while starting; what it had started is cleaned up", exc.sigval.name
        )
        return 128 + int(exc.sigval)


def _launch_and_clean_up(options: RunOptions, target: Target, *, dry_run: bool) -> int:
    target.check()
    options = for_embedded_etcd(options)
    if dry_run:
        print(dry_run_command(plan_launch(options, target)))
        return 0
    with contextlib.ExitStack() as cleanup:
        janitor = _start_janitor(cleanup)
        warm = _start_warm_server(cleanup, options) if options.warm_start == "on" else None
        # Up to here nothing imported torch (seconds on a cold start): a user's mistake is
        # answered in a fraction of a second.
        plan = plan_launch(options, target)
        from elastic_trainer.launch.job import run_job  # torch and torchrun (cost: see module doc)

        return run_job(plan, warm, janitor)


def _start_janitor(cleanup: contextlib.ExitStack) -> Janitor:
    """First in, last out: the janitor cleans up even after a SIGKILL of this process."""
    janitor = Janitor()
    cleanup.callback(janitor.close)
    for path in sweep_stale():  # what launchers killed with their janitor left
        log.info("removed %s (its launcher is gone)", path)
    # Workers (cold or warm-forked) inherit this marker: none outlives this launcher either.
    launcher_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tell_workers(LaunchContract(launcher_id=launcher_id))
    janitor.stop_processes_with_env(ENV_LAUNCHER_ID, launcher_id)
    return janitor


def _start_warm_server(cleanup: contextlib.ExitStack, options: RunOptions) -> WarmStartServer:
    """First of all: the server's imports then overlap the launcher's own and the rendezvous, so
    even a node's first workers (a join) do not wait for them in series."""
    extra = [name for name in options.warm_preload.split(",") if name]
    warm = start_server([*DEFAULT_PRELOAD, *extra])
    cleanup.callback(warm.close)
    return warm


class LauncherSignal(BaseException):
    """SIGTERM/SIGINT while the launcher starts, before torch's agent runs: a ``BaseException``,
    so that no ``except Exception`` on the way (a retry, an error translation) takes it for a
    failure; :func:`launch` turns it into one line and the exit status ``128 + signal``."""

    def __init__(self, sigval: signal.Signals) -> None:
        super().__init__(f"launcher got {sigval.name}")
        self.sigval = sigval


def install_sigterm_as_exception() -> None:
    """Make SIGTERM/SIGINT unwind the launcher (so ``finally`` blocks stop etcd) before torch
    installs its own handlers for its workers' lifetime: a signal raises :class:`LauncherSignal`,
    which needs no torch import (a signal may come in the middle of importing it). Once the agent
    runs, torch's ``SignalException`` takes over (``launch/job.py``)."""

    def raise_signal(signum: int, _frame: object) -> None:
        raise LauncherSignal(signal.Signals(signum))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, raise_signal)


def default_env_for_workers() -> None:
    """Environment defaults the workers inherit (never overriding the user's)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tell_workers(
        LaunchContract(reports_failures=True)
    )  # this launcher prints root causes: workers say one line
