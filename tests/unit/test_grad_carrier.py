"""The control carried by a gradient (``runtime/grad_carrier.py``) without a process group: the
encoding survives DDP's averaging exactly (simulated: each rank's gradient divided by the world
size, then summed in float32), the wrapper leaves the model's forward and gradients alone, and a
synchronised backward always gives the control parameter a gradient. The real three-rank run is
in ``test_buffers_ride_control.py``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from elastic_trainer.runtime import control_header
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.errors import ConfigError
from elastic_trainer.runtime.grad_carrier import ControlCarrier, buffer_values
from elastic_trainer.runtime.settings import ENV_CONTROL_CARRIER, WorkerSettings


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3), nn.Sigmoid())


def _carriers(world: int, values: int) -> list[ControlCarrier]:
    return [ControlCarrier(_model(), world_size=world, buffer_values=values) for _ in range(world)]


def _board(
    carrier: ControlCarrier,
    *,
    stop: float = 0.0,
    loss: float = 0.0,
    present: float = 0.0,
    buffers: np.ndarray | None = None,
) -> None:
    """Board ``[stop, loss, present, checkpoint failed = 0, no checksum, buffers...]`` as the
    channel does."""
    extra = buffers if buffers is not None else np.zeros(0)
    header = np.zeros(control_header.CONTROL_SLOTS)
    header[:3] = stop, loss, present
    carrier.board(np.concatenate([header, extra]), extra.size)


def _ddp_average(payloads: list[torch.Tensor], world: int) -> torch.Tensor:
    """What DDP's reducer makes of the ranks' gradients: each divided by the world size, summed."""
    total = torch.zeros_like(payloads[0])
    for payload in payloads:
        total += payload / world
    return total


@pytest.mark.parametrize("world", [2, 3, 7])
def test_the_control_survives_ddps_average_bit_for_bit(world: int) -> None:
    buffers = np.array(
        [1 / 3, -0.0, math.nan, 1e-310, 2.0**52 + 1, 3.0e38, -2.5, math.inf], dtype=np.float64
    )
    carriers = _carriers(world, buffers.size)
    losses = [0.1 * (rank + 1) + 1e-9 for rank in range(world)]
    for rank, carrier in enumerate(carriers):
        _board(
            carrier,
            stop=1.0 if rank == world - 1 else 0.0,
            loss=losses[rank],
            present=1.0,
            buffers=buffers if rank == 0 else None,
        )
    reduced = _ddp_average([c._deliver() for c in carriers], world)
    for carrier in carriers:
        carrier._aboard.control.grad = reduced.clone()
        control = np.zeros(control_header.CONTROL_SLOTS + buffers.size)
        assert carrier.collect(control, buffers.size)
        assert control[0] == 1.0 and control[2] == world and control[3] == 0.0
        assert control[1] == pytest.approx(sum(losses), rel=1e-6)
        assert (
            control[control_header.CONTROL_SLOTS :].view(np.uint64).tolist()
            == buffers.view(np.uint64).tolist()
        )
        # The next payload starts from a zero gradient (autograd adds into it in place).
        grad = carrier._aboard.control.grad
        _board(carrier)
        assert grad is not None and not grad.any(), "the gradient must not accumulate"


def test_a_payload_that_did_not_travel_on_every_rank_is_refused() -> None:
    carriers = _carriers(2, 0)
    _board(carriers[0], loss=1.0, present=1.0)
    # Rank 1 started its control after the backward: its backward delivered zeros.
    reduced = _ddp_average([c._deliver() for c in carriers], 2)
    for carrier in carriers:
        carrier._aboard.control.grad = reduced.clone()
    assert not carriers[0].collect(np.zeros(control_header.CONTROL_SLOTS), 0)
    assert not carriers[1].collect(
        np.zeros(control_header.CONTROL_SLOTS), 0
    )  # nothing delivered on this rank at all


def test_the_wrapper_keeps_the_models_output_and_gradients() -> None:
    plain, carried = _model(), ControlCarrier(_model(), world_size=2, buffer_values=12)
    x = torch.randn(5, 4)
    _board(carried, loss=2.0, present=1.0)
    out_plain, out_carried = plain(x), carried(x)
    assert torch.equal(out_plain, out_carried)
    # In place on the output, after a Sigmoid that saved it: the copy allows it (the plain
    # model's own output would not).
    out_carried.mul_(2.0)
    (out_plain * 2.0).sum().backward()
    out_carried.sum().backward()
    for (name, a), b in zip(plain.named_parameters(), carried.module.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad), name
    grad = carried.control.grad
    assert grad is not None and grad[0] == 2.0 and grad[4] == 4.0  # carried x2, loss 2.0 x2
    assert carried.module.state_dict().keys() == plain.state_dict().keys()


def test_only_a_synchronised_forward_carries_and_every_one_gives_a_gradient() -> None:
    carrier = ControlCarrier(_model(), world_size=2, buffer_values=12)

    class _Ddp:
        require_backward_grad_sync = False  # inside DDP's no_sync

    ddp = _Ddp()
    carrier.bind(ddp)
    carrier(torch.randn(5, 4)).sum().backward()
    assert carrier.control.grad is None
    ddp.require_backward_grad_sync = True
    carrier(torch.randn(5, 4)).sum().backward()  # nothing boarded (a priming pass): zeros
    grad = carrier.control.grad
    assert grad is not None and not grad.any()
    with torch.no_grad():
        carrier(torch.randn(5, 4))  # evaluation: nothing attached, nothing to fail


def test_a_carrier_is_made_only_where_it_applies() -> None:
    def env(**kw: object) -> DistEnv:
        base = {"world_size": 2, "device": torch.device("cpu"), "backend": "gloo"}
        return SimpleNamespace(**(base | kw))  # type: ignore[return-value]

    assert ControlCarrier.maybe(_model(), env()) is not None
    assert ControlCarrier.maybe(_model(), env(), enabled=False) is None  # the opt-out
    assert ControlCarrier.maybe(_model(), env(world_size=1)) is None
    assert ControlCarrier.maybe(_model(), env(backend="nccl")) is None
    assert ControlCarrier.maybe(_model(), env(device=torch.device("cuda", 0))) is None
    assert ControlCarrier.maybe(_model().double(), env()) is None  # no float32 bucket to join
    assert buffer_values(_model()) == 6 + 6 + 1  # running mean, var, and the batch counter


def test_the_carrier_is_the_default_and_the_variable_opts_out() -> None:
    assert WorkerSettings.from_environ({}).control_carrier
    assert not WorkerSettings.from_environ({ENV_CONTROL_CARRIER: "0"}).control_carrier
    assert WorkerSettings.from_environ({ENV_CONTROL_CARRIER: "1"}).control_carrier
    with pytest.raises(ConfigError, match=ENV_CONTROL_CARRIER):
        WorkerSettings.from_environ({ENV_CONTROL_CARRIER: "maybe"})


def test_the_models_own_attributes_are_reached_through_the_carrier() -> None:
    """``ddp.module`` is the carrier on the CPU: a user's ``ddp.module.generate(...)`` or
    ``ddp.module.config`` must reach the model as on a GPU, where there is no carrier."""

    class WithExtras(nn.Sequential):
        config = {"width": 6}

        def generate(self, x: torch.Tensor) -> torch.Tensor:
            return self(x).argmax(-1)

    torch.manual_seed(0)
    model = WithExtras(nn.Linear(4, 3))
    carrier = ControlCarrier(model, world_size=2, buffer_values=0)
    x = torch.randn(5, 4)
    assert carrier.config == {"width": 6}
    assert torch.equal(carrier.generate(x), model.generate(x))
    assert carrier.module is model
    with pytest.raises(AttributeError, match="nothing_here"):
        _ = carrier.nothing_here
