"""The healer's stop watch sees a training thread blocked in a gradient bucket's wait.

At the defaults DDP waits on its buckets in C++ (no comm hook, issue 30), where an abort does not
reach a send gloo left blocked; the stop watch ends such a process after ``BUCKET_WAIT_IDLE_S``
instead of ``STUCK_IDLE_S``, recognising the wait by the thread's place (inside the backward)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from elastic_trainer.heal.healer import Healer, in_backward
from elastic_trainer.runtime.abortable import AbortableWaits


class _Blocking(torch.autograd.Function):
    """A backward that waits like DDP's finalize on a blocked bucket: no CPU, inside the engine."""

    inside = threading.Event()
    release = threading.Event()

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _Blocking.inside.set()
        _Blocking.release.wait(30)
        return grad


def test_a_thread_waiting_inside_the_backward_is_seen_there_and_not_elsewhere() -> None:
    ident: list[int] = []

    def train() -> None:
        ident.append(threading.get_ident())
        x = torch.ones(3, requires_grad=True)
        _Blocking.apply(x).sum().backward()

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        assert _Blocking.inside.wait(30)
        assert in_backward(ident[0])
        # What the healer asks: only where its waits are the abortable kind (gloo on the CPU).
        healer = Healer.__new__(Healer)
        healer._training_ident = ident[0]
        healer.waits = AbortableWaits(enabled=True)
        assert healer._in_bucket_wait()
        healer.waits = AbortableWaits(enabled=False)  # NCCL: its abort reaches the buckets
        assert not healer._in_bucket_wait()
    finally:
        _Blocking.release.set()
        thread.join(30)
    assert not in_backward(threading.get_ident()), "this thread is in a test, not in a backward"
    assert not in_backward(ident[0]), "a finished thread is nowhere"
