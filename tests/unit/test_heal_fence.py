"""A process whose training thread never left its epoch after it told a round it lives is ended
like a crash (so that a replacement joins), never one that is healing or healed."""

from __future__ import annotations

import signal
import threading
from types import SimpleNamespace

import pytest

from elastic_trainer.heal import healer as healer_module
from elastic_trainer.heal.healer import Healer
from elastic_trainer.heal.protocol import Epoch, Member

EPOCH = Epoch(number=3, members=(Member(id="a/0/1", slot="a/0"),), step=7, source=None, started_unix=1.0,
              reason="r")  # fmt: skip


def healer_in(phase: str, epoch: Epoch) -> Healer:
    healer = object.__new__(Healer)  # only the fence's state: no etcd, no group
    healer._phase, healer._phase_lock, healer._epoch = phase, threading.Lock(), epoch
    healer.membership = SimpleNamespace(rules=SimpleNamespace(ready_timeout_s=60.0))  # type: ignore[assignment]
    return healer


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    found: list[tuple[int, int]] = []
    monkeypatch.setattr(healer_module.os, "kill", lambda pid, sig: found.append((pid, sig)))
    monkeypatch.setattr(healer_module.faulthandler, "dump_traceback", lambda **_: None)
    return found


def test_a_training_thread_stuck_in_its_epoch_ends_the_process(kills: list[tuple[int, int]]) -> None:
    healer_in("training", EPOCH)._fence_if_stuck(EPOCH, 4)
    assert kills == [(healer_module.os.getpid(), signal.SIGKILL)]


def test_a_process_that_healed_or_is_healing_is_left_alone(kills: list[tuple[int, int]]) -> None:
    healer_in("healing", EPOCH)._fence_if_stuck(EPOCH, 4)
    later = Epoch(number=4, members=EPOCH.members, step=8, source=None, started_unix=2.0, reason="r")
    healer_in("training", later)._fence_if_stuck(EPOCH, 4)
    assert kills == []
