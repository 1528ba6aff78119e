"""The one place that reaches into a private part of torch's elastic agent (torch 2.13).

torchrun's ``SimpleElasticAgent._invoke_run`` restarts a failed worker group while
``_remaining_restarts > 0``, whatever the failure. :func:`on_group_failure` lets the launcher look
at the failures first (``LocalElasticAgent._monitor_workers`` returns them) and spend no restart on
one that cannot heal, by setting ``_remaining_restarts`` to 0: the agent then stops its workers and
returns the failure exactly as after its last restart. Checked against torch 2.13's
``torch/distributed/elastic/agent/server/api.py``; on a torch without these names the hook is not
installed (restarts then follow ``--max-restarts`` as plain torchrun does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

GroupFailureCallback = Callable[[dict[int, Any], int], bool]
"""``(failures by global rank, restarts left) -> may the agent restart?``"""


def on_group_failure(callback: GroupFailureCallback) -> Callable[[], None]:
    """Call ``callback`` whenever the agent finds its worker group failed, before it restarts it.

    Returns:
        A function that removes the hook.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = getattr(LocalElasticAgent, "_monitor_workers", None)
    if original is None or not hasattr(LocalElasticAgent, "_restart_workers"):
        log.warning("this torch's elastic agent has no _monitor_workers: every failure is retried up to "
                    "--max-restarts times")
        return lambda: None

    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            remaining = int(getattr(self, "_remaining_restarts", 0))
            if not callback(dict(result.failures), remaining):
                self._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = _monitor_workers  # type: ignore[method-assign]

    def uninstall() -> None:
        LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]

    return uninstall
