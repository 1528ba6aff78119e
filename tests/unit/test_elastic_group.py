"""ElasticGroup's attempts: a group failure is healed and suppressed, everything else is not.

The healer and the loop are fakes here (the real ones run in tests/integration/test_own_loop.py and
the chaos suite); the DDP whose hooks a heal removes is real, on a one-rank gloo group.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_trainer.heal.healer import HealError, HealOutcome, RunFinished
from elastic_trainer.runtime.distributed import DistEnv, read_env
from elastic_trainer.runtime.settings import WorkerSettings
from elastic_trainer.train.elastic_group import ElasticGroup
from elastic_trainer.train.loop import TrainResult

GROUP_FAILURE = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"


class FakeHealer:
    def __init__(self, *, fails_with: BaseException | None = None) -> None:
        self.fails_with = fails_with
        self.heals = 0
        self.calls: list[dict[str, Any]] = []
        self.finished: list[DistEnv] = []
        self.offer: Any = None
        self.offer_during_heal: Any = None

    def check(self) -> None:
        pass

    def offer_state(self, hand_on: Any) -> None:
        self.offer = hand_on

    def commit_fence(self) -> str | None:
        return None

    def heal(self, env: DistEnv, *, step: int, snapshot: Any, reason: str) -> HealOutcome:
        self.calls.append({"step": step, "reason": reason, "snapshot": snapshot()})
        self.offer_during_heal = self.offer
        if self.fails_with is not None:
            raise self.fails_with
        self.heals += 1
        return HealOutcome(
            env=dataclasses.replace(env, rank=1, world_size=3),
            epoch=None,  # type: ignore[arg-type]
            state={"from": "peer"},
            took_s=0.1,
        )

    def finish(self, env: DistEnv, step: int | None = None) -> None:
        self.finished.append(env)
        self.finished_at = step


class FakeState:
    consistent = True
    step = 7
    sharded = None  # a replicated state

    def peer_snapshot(self, timeout: float) -> dict[str, Any]:
        return {"step": 7}


class FakeJustInTime:
    def __init__(self) -> None:
        self.failures: list[BaseException] = []

    def after_failure(self, exc: BaseException) -> None:
        self.failures.append(exc)


class FakeCheckpoints:
    def __init__(self) -> None:
        self.just_in_time = FakeJustInTime()


def _env() -> DistEnv:
    return read_env(environ={"RANK": "0", "WORLD_SIZE": "2"}, cuda_devices=0)


def _group(healer: FakeHealer | None) -> tuple[ElasticGroup, SimpleNamespace]:
    group = ElasticGroup(WorkerSettings(), _env())
    group.healer = healer  # type: ignore[assignment]
    loop = SimpleNamespace(
        state_ready=True,
        heals_in_place=True,
        step=7,
        stop_requested=False,
        state=FakeState(),
        checkpoints=FakeCheckpoints(),
        sampler=SimpleNamespace(epoch=2),
        result=TrainResult(
            step=9, epoch=2, loss=0.5, resumed_from=None, stopped_by_signal=False, checkpoint=None
        ),
    )
    group._loop = loop  # type: ignore[assignment]
    return group, loop


def test_a_group_failure_is_healed_and_the_next_attempt_has_the_new_place_and_state() -> None:
    healer = FakeHealer()
    group, loop = _group(healer)
    seen: list[tuple[int, int, Any]] = []
    for attempt in group.attempts():
        seen.append((attempt.env.rank, attempt.env.world_size, attempt.initial_state))
        with attempt:
            if len(seen) == 1:
                raise RuntimeError(GROUP_FAILURE + "\nmore lines")
    assert seen == [(0, 2, None), (1, 3, {"from": "peer"})]
    # The round's reason in plain words, not gloo's transport text (issue 31).
    assert healer.calls == [
        {
            "step": 7,
            "reason": "a collective failed: a peer's connection closed (its process or node died)",
            "snapshot": {"step": 7},
        }
    ]
    assert healer.offer is None, "withdrawn once the attempt is over (the model is written next)"
    assert [env.rank for env in healer.finished] == [1], "rank 1 of the healed epoch marks the end"
    assert healer.finished_at == 9, "with the last step (status says 'finished at step 9')"
    assert group.result is loop.result


def test_without_healing_there_is_one_attempt_and_a_group_failure_ends_it() -> None:
    group, _ = _group(None)
    attempts = 0
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        for attempt in group.attempts():
            attempts += 1
            with attempt:
                raise RuntimeError(GROUP_FAILURE)
    assert attempts == 1


def test_a_state_no_peer_can_hand_on_restarts_instead_of_healing() -> None:
    """A sharded state (each rank holds only its own shards): the group failure ends the attempt
    as without healing (the group restarts from the newest checkpoint)."""
    healer = FakeHealer()
    group, loop = _group(healer)
    loop.heals_in_place = False
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        for attempt in group.attempts():
            with attempt:
                raise RuntimeError(GROUP_FAILURE)
    assert healer.calls == []


def test_a_sharded_state_hands_on_its_shards_not_a_snapshot() -> None:
    """A sharded attempt that holds its neighbour copy heals at the copy's step, and offers no
    replicated snapshot (its shards are restored where they survived); one that failed before it
    held a copy (a fault while the model was built again) offers nothing: the job goes on from the
    newest checkpoint, never from this rank's shards sent as if they were a replica."""
    for held, step in ((SimpleNamespace(step=5), 5), (None, -1)):
        healer = FakeHealer()
        group, loop = _group(healer)
        loop.state.sharded = object()
        for attempt in group.attempts():
            with attempt:
                if not healer.calls:
                    if held is not None:
                        attempt.hold(held)
                    raise RuntimeError(GROUP_FAILURE)
        assert healer.calls[0]["step"] == step and healer.calls[0]["snapshot"] == {}


def test_a_bug_in_the_step_is_not_healed() -> None:
    healer = FakeHealer()
    group, _ = _group(healer)
    with pytest.raises(ValueError, match="shape mismatch"):
        for attempt in group.attempts():
            with attempt:
                raise ValueError("shape mismatch")
    assert healer.calls == [] and healer.finished == []


def test_a_heal_that_fails_saves_just_in_time_and_raises_the_collective_failure() -> None:
    healer = FakeHealer(fails_with=HealError("no epoch within 60 s"))
    group, loop = _group(healer)
    with pytest.raises(RuntimeError, match="Connection closed by peer") as raised:
        for attempt in group.attempts():
            with attempt:
                raise RuntimeError(GROUP_FAILURE)
    assert isinstance(raised.value.__cause__, HealError)
    assert loop.checkpoints.just_in_time.failures == [raised.value], (
        "the last step is saved just in time"
    )


def test_a_job_that_finished_during_the_heal_ends_the_attempts_quietly() -> None:
    group, _ = _group(FakeHealer(fails_with=RunFinished("done")))
    attempts = 0
    for attempt in group.attempts():
        attempts += 1
        with attempt:
            raise RuntimeError(GROUP_FAILURE)
    assert attempts == 1
    assert group.result is not None and group.result.finished and group.result.step == 7


def test_the_broken_group_s_ddp_reduces_no_more_gradients(gloo_world: None) -> None:
    healer = FakeHealer()
    group, _ = _group(healer)
    model = nn.Linear(4, 2)
    reduced: list[int] = []
    released: list[int] = []

    def counting_hook(
        state, bucket
    ):  # unannotated: DDP checks annotations, and these are strings here
        reduced.append(1)
        return allreduce_hook(None, bucket)

    old: DDP | None = None
    for attempt in group.attempts():
        with attempt:
            if old is not None:
                break  # the second attempt: healed
            old = DDP(model)
            old.register_comm_hook(
                None, counting_hook
            )  # first: wrap adds no hook to a DDP that has one
            attempt.wrap(old, release=lambda: released.append(len(healer.calls)))
            old(torch.randn(3, 4)).sum().backward()
            assert reduced == [1]
            raise RuntimeError(GROUP_FAILURE)
    assert old is not None
    old(torch.randn(3, 4)).sum().backward()  # still held here, as the caller's variable would be
    assert reduced == [1], "the old DDP's hooks were removed at the heal"
    assert released == [0], "the caller let go of the old DDP once, before the heal moved any state"


def test_the_loop_s_offer_to_hand_its_state_on_stands_through_the_heal() -> None:
    """A heal only reads the model: a process stuck while it heals can still save the step it held."""
    healer = FakeHealer()
    group, loop = _group(healer)
    for attempt in group.attempts():
        with attempt:
            if not healer.calls:
                healer.offer_state("the loop's offer")  # what Attempt.loop() does
                raise RuntimeError(GROUP_FAILURE)
    assert healer.offer_during_heal == "the loop's offer" and healer.offer is None


def test_at_the_defaults_ddp_reduces_its_buckets_with_no_python_comm_hook(gloo_world: None) -> None:
    """Issue 30: healing in place (the healer's abortable waits on, as on gloo/CPU) and every
    allreduce metrics mode leave DDP's buckets to its C++ allreduce. The counter-check: a hook
    registered on the same path (here by the caller, before ``wrap``) is seen by the same reader."""
    from prometheus_client import CollectorRegistry

    from elastic_trainer.metrics.worker import PrometheusObserver, WorkerLabels
    from elastic_trainer.runtime import torch_compat
    from elastic_trainer.runtime.abortable import AbortableWaits
    from elastic_trainer.runtime.comms import WorkerComms

    labels = WorkerLabels(run_id="job", node="n", rank=0, local_rank=0)
    hooks: dict[str, list[Any]] = {}
    for mode, observer in (
        ("defaults", PrometheusObserver(labels=labels, registry=CollectorRegistry())),
        ("trace", PrometheusObserver(labels=labels, registry=CollectorRegistry(), trace_allreduce=True)),
        ("off", PrometheusObserver(labels=labels, registry=CollectorRegistry(), time_allreduce=False)),
        ("a hook", PrometheusObserver(labels=labels, registry=CollectorRegistry())),
    ):  # fmt: skip
        group, _ = _group(FakeHealer())
        group.comms = WorkerComms(
            waits=AbortableWaits(enabled=True)
        )  # what ElasticGroup takes from a gloo/CPU healer
        for attempt in group.attempts():
            with attempt:
                ddp = DDP(nn.Linear(4, 2))
                if mode == "a hook":
                    ddp.register_comm_hook(None, allreduce_hook)
                ddp = attempt.wrap(ddp, observer)
                ddp(torch.randn(3, 4)).sum().backward()
                hooks[mode] = torch_compat.comm_hooks(ddp)
    for mode in ("defaults", "trace", "off"):
        assert hooks[mode] == [], f"a Python comm hook on DDP's buckets ({mode}): {hooks[mode]}"
    assert hooks["a hook"] == [allreduce_hook]


def test_a_program_with_no_logging_of_its_own_is_told_its_rank_and_pid() -> None:
    """The FSDP2 pattern forms the group with ``ElasticGroup`` before ``Elastic`` exists; the line
    that names the worker's rank and pid (how docs/launcher.md finds a worker to kill) must not be
    dropped for want of a logging setup (a new user found no such line until after a heal)."""
    code = (
        "from elastic_trainer import ElasticGroup\n"
        "with ElasticGroup() as group:\n"
        "    print('formed', group.env.world_size, flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "formed 1" in out
    assert f"rank 0/1 (local 0, pid {proc.pid})" in err, err
