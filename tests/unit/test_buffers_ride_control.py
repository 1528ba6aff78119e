"""Rank 0's buffers riding on the step's control allreduce stand in for DDP's forward-time buffer
broadcast bit for bit: three real gloo processes train a BatchNorm model on different data per
rank, with gradient accumulation, once with DDP broadcasting buffers at each synced forward and
once with ``forward_sync_buffers=False`` and ``AuthoritativeBuffers(apply=True)``. Every rank
ends with the same weights and buffers in both runs; without either, the ranks' buffers drift.

This file is also the worker script: ``python -m tests.unit.test_buffers_ride_control MODE[,MODE] RANK DIR``
(one process per rank runs the modes one after the other, each in a process group of its own:
three process starts per test instead of three per mode).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_trainer.examples.synthetic_cnn import SmallCNN
from elastic_trainer.runtime.settings import ENV_CONTROL_CARRIER
from elastic_trainer.state.buffers import replaces_buffer_broadcast

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
WORLD, STEPS, MICRO = 3, 6, 2
BIG = 2**52 + 2**26 + 1
# Each mode's DDP stays referenced until ``os._exit``: freeing it would run the gloo group's
# destructor from the Reducer, with the GIL held, and that destructor joins the group's worker
# threads; a worker still destroying the last barrier's work needs the GIL for the Python context
# torch 2.13 stashes in the thread-local state of each backward's collectives, so both wait for
# good (seen 2 times in 19 runs at load 4; py-spy stacks in the commit message).
_KEPT: list[object] = []


# -- worker side ---------------------------------------------------------------------------------------
class _Counter(torch.nn.Module):
    """An int64 buffer that float32 halves cannot carry (its low half needs 27 bits), moved by
    each forward by a rank-dependent amount."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.register_buffer("big", torch.tensor(BIG, dtype=torch.int64))
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.big.add_(1 + self.rank)
        return x


def _worker(mode: str, rank: int, work: Path) -> None:
    """``mode``: how buffers are synchronised (``ddp``: DDP's broadcast; ``ride``: on the control
    allreduce; ``carry``: on the control carried by the gradient of a :class:`ControlCarrier`
    parameter; ``none``), with ``+big`` an int64 buffer that float32 halves cannot carry exactly."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.runtime.grad_carrier import ControlCarrier
    from elastic_trainer.runtime.step_control import ControlChannel
    from elastic_trainer.state.buffers import AuthoritativeBuffers

    sync, big = mode.split("+")[0], mode.endswith("+big")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{work / f'store-{mode}'}", rank=rank, world_size=WORLD
    )
    env = read_env(
        environ={"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": "0"}, cuda_devices=0
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Counter(rank), SmallCNN(8)) if big else SmallCNN(8)
    carrier = ControlCarrier.maybe(model, env) if sync == "carry" else None
    ddp = DDP(carrier or model, forward_sync_buffers=(sync == "ddp"))
    if carrier is not None:
        carrier.bind(ddp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    channel = ControlChannel(env, carrier=carrier)
    separate = []  # the control's own collectives
    own_allreduce = channel._allreduce
    channel._allreduce = lambda host: (separate.append(1), own_allreduce(host))[1]  # type: ignore[method-assign]
    buffers = AuthoritativeBuffers(
        model, rank=rank, world_size=WORLD, apply=sync in ("ride", "carry")
    )
    buffers.capture(identical=True)
    seen: list[
        torch.Tensor
    ] = []  # the buffers each forward starts from (after DDP's broadcast, if any)
    model.register_forward_pre_hook(
        lambda *_: seen.append(torch.cat([b.double().flatten() for b in model.buffers()]))
    )
    data = torch.Generator().manual_seed(100 + rank)  # each rank sees different batches
    results = []
    for step in range(1, STEPS + 1):
        optimizer.zero_grad(set_to_none=True)
        pending = None
        for micro in range(MICRO):
            x = torch.randn(4, 3, 8, 8, generator=data) * (1 + rank)
            y = torch.randint(0, 10, (4,), generator=data)
            last = micro == MICRO - 1
            with ddp.no_sync() if not last else torch.enable_grad():
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                if last:
                    pending = channel.start(
                        step,
                        loss.detach() * 4,
                        global_samples=WORLD * 4,
                        stop=rank == 2 and step == 4,
                        buffers=buffers.capture(),
                    )
                loss.backward()
        assert pending is not None
        channel.wait_before_update(pending)
        optimizer.step()
        buffers.commit(pending.buffers)
        result = channel.finish(pending)
        results.append([result.stop, result.loss_step, result.loss])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(
        {"state": state, "seen": torch.stack(seen), "results": results, "separate": len(separate)},
        work / f"{mode}-{rank}.pt",
    )
    _KEPT.append(ddp)
    dist.barrier()
    dist.destroy_process_group()  # the next mode forms a group of its own


# -- test side -------------------------------------------------------------------------------------------
def _run(modes: str, work: Path) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Per mode of the comma-separated ``modes``, per rank: ``state`` (the final state_dict) and
    ``seen`` (one row of buffers per forward)."""
    work.mkdir()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.unit.test_buffers_ride_control",
                modes,
                str(rank),
                str(work),
            ],
            cwd=ROOT,
            # At the defaults (the carrier on): whatever the caller's environment chose.
            env={k: v for k, v in os.environ.items() if k != ENV_CONTROL_CARRIER},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"{modes} rank {rank}: {out[-2000:]}"
    return {
        mode: [torch.load(work / f"{mode}-{rank}.pt", weights_only=True) for rank in range(WORLD)]
        for mode in modes.split(",")
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_buffers_on_the_control_equal_ddps_broadcast_bit_for_bit(tmp_path: Path) -> None:
    runs = _run("ddp,ride,none", tmp_path / "runs")
    ddp, ride, drift = runs["ddp"], runs["ride"], runs["none"]
    assert ddp[0]["seen"].shape[0] == STEPS * MICRO
    assert not torch.equal(ddp[0]["seen"][0], ddp[0]["seen"][-1]), "BN statistics never changed"
    for rank in range(WORLD):
        # Every forward of every rank starts from the same buffers, bit for bit (as float64 rows:
        # float32 statistics and the int64 counter both round-trip exactly).
        assert torch.equal(_bits(ride[rank]["seen"]), _bits(ddp[rank]["seen"])), (
            f"rank {rank}: buffers differ"
        )
        for key, value in ddp[rank]["state"].items():
            if key in dict(SmallCNN(8).named_parameters()):
                assert torch.equal(_bits(ride[rank]["state"][key]), _bits(value)), (
                    f"rank {rank}: {key} differs"
                )
    # Rank 0's final buffers (what it checkpoints) are the same; the other ranks hold rank 0's too.
    for key, value in ddp[0]["state"].items():
        assert all(
            torch.equal(_bits(ride[rank]["state"][key]), _bits(value)) for rank in range(WORLD)
        ), key
    # Each step's first forward starts from rank 0's buffers (the later micro-batches from the
    # rank's own, as DDP does). The comparison can fail: with neither, every forward starts from
    # the rank's own statistics.
    firsts = slice(None, None, MICRO)
    assert all(
        torch.equal(ddp[rank]["seen"][firsts], ddp[0]["seen"][firsts]) for rank in range(WORLD)
    )
    assert not torch.equal(ddp[1]["seen"][1::MICRO], ddp[0]["seen"][1::MICRO])
    assert not torch.equal(drift[1]["seen"][firsts], drift[0]["seen"][firsts])


def test_the_control_carried_by_a_gradient_is_exact_and_needs_no_collective(
    tmp_path: Path,
) -> None:
    """The default on the CPU: DDP reduces the control with the gradients, in C++. Three ranks
    (DDP divides by 3, which no float32 halves survive): the stop flag, the loss and rank 0's
    buffers arrive as on the control's own collective, int64 counters included, and no step
    needs a collective of its own."""
    runs = _run("ride,carry+big", tmp_path / "runs")
    ride, carry = runs["ride"], runs["carry+big"]
    firsts = slice(None, None, MICRO)
    for rank in range(WORLD):
        assert carry[rank]["separate"] == 0, "the control still had a collective"
        assert torch.equal(_bits(carry[rank]["seen"][firsts]), _bits(carry[0]["seen"][firsts]))
        counter = carry[rank]["seen"][firsts, 0].to(torch.int64)
        assert counter.tolist() == [BIG + MICRO * step for step in range(STEPS)]
        assert [r[:2] for r in carry[rank]["results"]] == [r[:2] for r in ride[rank]["results"]]
        assert [r[0] for r in carry[rank]["results"]] == [step == 4 for step in range(1, STEPS + 1)]
        losses = [
            (a, b)
            for (_, _, a), (_, _, b) in zip(
                carry[rank]["results"], ride[rank]["results"], strict=True
            )
        ]
        assert losses[0] == (None, None)
        assert all(a is not None and abs(a - b) <= 1e-6 * abs(b) for a, b in losses[1:]), losses
        for key, value in ride[rank]["state"].items():  # "1.": the CNN behind the counter
            mine = carry[rank]["state"]["1." + key]
            assert torch.allclose(mine.double(), value.double(), rtol=1e-5, atol=1e-6), key


def test_only_models_whose_every_buffer_rides_exactly_replace_the_broadcast() -> None:
    assert replaces_buffer_broadcast(SmallCNN(4))
    assert not replaces_buffer_broadcast(
        SmallCNN(4, batchnorm=False)
    )  # no buffer: nothing to replace
    with_scratch = SmallCNN(4)
    with_scratch.register_buffer(
        "scratch", torch.zeros(2), persistent=False
    )  # DDP broadcasts it; it does not ride
    assert not replaces_buffer_broadcast(with_scratch)
    with_complex = SmallCNN(4)
    with_complex.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
    assert not replaces_buffer_broadcast(with_complex)
    with_prime = SmallCNN(4)  # a hashing constant float64 would round: DDP keeps broadcasting
    with_prime.register_buffer("prime", torch.tensor([7, 2**61 - 1]))
    assert not replaces_buffer_broadcast(with_prime)
    with_counter = SmallCNN(4)
    with_counter.register_buffer("seen", torch.tensor(2**40))
    assert replaces_buffer_broadcast(with_counter)


if __name__ == "__main__":
    for each_mode in sys.argv[1].split(","):
        _worker(each_mode, int(sys.argv[2]), Path(sys.argv[3]))
    # Skip interpreter teardown: tearing gloo down can abort ("terminate called without an
    # active exception"), as tests/integration/scripts/ddp_steps.py notes.
    sys.stdout.flush()
    os._exit(0)
