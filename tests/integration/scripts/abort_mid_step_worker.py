"""A gloo worker for test_abort_mid_step: DDP training of the example CNN in groups that are
aborted mid-step, again and again (HealableGroup.abort and the tracked waits, as the healer does
when a heal round opens), with the opt-in hooks that track every bucket's wait
(``runtime/comms.py``). Every abort must end the step at once; gloo alone sometimes leaves a
gradient bucket's send blocked until the group's timeout (runtime/abortable.py). At the defaults
no hook tracks the buckets and the healer's stop watch ends such a process instead
(``tests/unit/test_heal_stop_watch.py``).

    python abort_mid_step_worker.py RANK STORE_FILE ITERATIONS HOOK OUT_FILE    # HOOK: timed | plain
"""

from __future__ import annotations

import faulthandler
import inspect
import json
import random
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_trainer.examples.synthetic_cnn import SmallCNN
from elastic_trainer.heal.group import HealableGroup
from elastic_trainer.metrics.allreduce_hook import AllreduceTimer, timed_allreduce_hook
from elastic_trainer.runtime.abortable import AbortableWaits
from elastic_trainer.runtime.comms import WorkerComms, abortable_allreduce_hook
from elastic_trainer.runtime.failures import is_collective_failure as is_group_failure

BOUND_S = 10.0
"""An abort that has not ended the step by then counts as blocked (gloo's own timeout: 600 s here)."""


def main() -> None:
    faulthandler.register(
        signal.SIGUSR1, all_threads=True
    )  # the test asks for stacks before it kills
    rank, store_file, iterations, hook, out = (
        int(sys.argv[1]),
        sys.argv[2],
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    comms = WorkerComms(waits=AbortableWaits(enabled=True))
    store = dist.FileStore(store_file, 2)
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, target = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    group = HealableGroup("gloo", timeout_s=600.0, waits=comms.waits)
    chance = random.Random(rank)
    # The forward's buffer broadcast is DDP's own wait, which no hook reaches (the healer's stop
    # watch covers it): off here, so that only the tracked waits are measured.
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
        else {"broadcast_buffers": False}
    )
    ended_after: list[float] = []
    for iteration in range(iterations):
        group.create(rank=rank, world_size=2, store=dist.PrefixStore(f"it-{iteration}", store))
        ddp = DDP(model, **no_buffer_sync)
        if hook == "timed":
            ddp.register_comm_hook(
                AllreduceTimer(ddp.process_group, comms=comms), timed_allreduce_hook
            )
        else:
            ddp.register_comm_hook(comms, abortable_allreduce_hook)
        # Two steps before any abort: DDP's second forward rebuilds its buckets with a broadcast of
        # its own, which no hook reaches either (in a worker the stop watch covers it, as it does
        # the buffer broadcast).
        for _ in range(2):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(ddp(inputs), target).backward()
            optimizer.step()
        store.set(f"ready-{iteration}-{rank}", "1")
        store.wait([f"ready-{iteration}-{1 - rank}"])
        aborted_at: list[float] = []

        def abort(
            delay: float = chance.uniform(0.0, 0.08), stamps: list[float] = aborted_at
        ) -> None:
            time.sleep(delay)
            stamps.append(time.monotonic())
            group.abort()
            comms.waits.abort("test")

        aborter = threading.Thread(target=abort, daemon=True)
        aborter.start()
        failure: BaseException | None = None
        deadline = time.monotonic() + BOUND_S + 5
        try:
            while time.monotonic() < deadline:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(ddp(inputs), target).backward()
                optimizer.step()
        except Exception as exc:  # noqa: BLE001 - what the healer would catch
            failure = exc
        aborter.join()
        if failure is None or not is_group_failure(failure):
            raise SystemExit(
                f"iteration {iteration}: the abort did not fail the step as a group failure: {failure!r}"
            )
        ended_after.append(time.monotonic() - aborted_at[0])
        del ddp
        group.destroy()
        store.set(f"done-{iteration}-{rank}", "1")
        store.wait([f"done-{iteration}-{1 - rank}"])
    with open(out, "w") as file:
        json.dump({"ended_after_s": ended_after}, file)


if __name__ == "__main__":
    main()
    import os

    os._exit(0)  # a kept group's threads may still be blocked: skip their teardown
