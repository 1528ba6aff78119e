"""The replicas' parameter check on the step's control: two real gloo ranks on ``Elastic``, one of
which updates differently (its own learning rate, as an own step counter would set it), stop with
one error naming the step; alike replicas run on. Both control paths: aboard DDP's gradient (the
default on the CPU) and on the control's own collective (``ELASTIC_TRAINER_CONTROL_CARRIER=0``)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import TensorDataset

from elastic_trainer.runtime import control_header
from elastic_trainer.train.replica_check import ReplicaLayout, checksum_bits

pytestmark = pytest.mark.timeout(180)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train(rank: int, out: str, model: nn.Module, features: int, lr_at_2: float | None) -> None:
    """Six steps of ``Elastic`` on ``model``; ``lr_at_2``: this rank's own learning rate from step 2
    (as an own step counter would set it). Writes how the run ended to ``out/rank<r>``."""
    from elastic_trainer import Elastic

    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, features, generator=g)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    elastic = Elastic(model, data, global_batch_size=8, max_steps=6, log_every=1000)
    reached = 0
    try:
        for step in elastic:
            with step:
                for xb, yb in step:
                    step.backward(nn.functional.cross_entropy(elastic.module(xb), yb) * step.weight)
                if lr_at_2 is not None and step.number == 2:
                    optimizer.param_groups[0]["lr"] = lr_at_2
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            reached = step.number
        Path(out, f"rank{rank}").write_text(f"finished {reached}")
    except SystemExit as exc:  # Elastic's end for a mistake: one line on stderr, exit status 2
        Path(out, f"rank{rank}").write_text(f"exit {exc.code} after step {reached}")


def _worker(rank: int, port: int, out: str, diverge: bool, carrier: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        ELASTIC_TRAINER_CONTROL_CARRIER=carrier, ELASTIC_TRAINER_REPLICA_CHECK_EVERY="4",
        ELASTIC_TRAINER_REPORTS_FAILURES="",  # no launcher: each rank says its line
    )  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    _train(rank, out, model, 6, 0.1 + 0.05 * rank if diverge else None)


@pytest.mark.parametrize("carrier", ["1", "0"])
def test_a_rank_that_updates_differently_stops_the_job_naming_the_step(
    tmp_path: Path, carrier: str, capfd: pytest.CaptureFixture[str]
) -> None:
    mp.spawn(_worker, args=(_port(), str(tmp_path), True, carrier), nprocs=2)
    for rank in range(2):
        text = (tmp_path / f"rank{rank}").read_text()
        assert text.startswith("exit 2 after step "), text
        assert int(text.split()[-1]) < 6, text  # stopped before the end
    lines = [line for line in capfd.readouterr().err.splitlines() if "replicas' parameters" in line]
    assert len(lines) == 2, lines  # one line a rank
    for line in lines:
        assert "differ after step 2 (equal after step 1)" in line, line
        assert "own step counter" in line


@pytest.mark.parametrize("carrier", ["1", "0"])
def test_alike_replicas_run_to_the_end(tmp_path: Path, carrier: str) -> None:
    mp.spawn(_worker, args=(_port(), str(tmp_path), False, carrier), nprocs=2)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["finished 6"] * 2


def _hsdp_worker(rank: int, port: int, out: str, diverge: bool) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", LOCAL_WORLD_SIZE="4",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        ELASTIC_TRAINER_REPLICA_CHECK_EVERY="4", ELASTIC_TRAINER_REPORTS_FAILURES="",
    )  # fmt: skip
    import torch.distributed as dist

    from elastic_trainer import FSDPOptions
    from elastic_trainer.train.fsdp import shard_model
    from tests.unit.test_fsdp_options import Net

    dist.init_process_group("gloo", rank=rank, world_size=4)
    torch.manual_seed(0)
    hsdp = FSDPOptions(blocks=("blocks.*",), replicas=2)
    model = shard_model(Net(), hsdp, torch.device("cpu"), 4)
    _train(rank, out, model, 8, 0.2 if diverge and rank == 3 else None)  # replica 1 of shard 1


@pytest.mark.parametrize("diverge", [True, False])
def test_hsdp_replicas_are_compared_across_the_replicate_dim(
    tmp_path: Path, diverge: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    """A 2x2 HSDP model on 4 gloo ranks: shard 1's replicas updating differently stop every rank
    with one line naming shard 1 and the step; replicas alike (their shards differing from each
    other by design) run to the end."""
    mp.spawn(_hsdp_worker, args=(_port(), str(tmp_path), diverge), nprocs=4)
    texts = [(tmp_path / f"rank{rank}").read_text() for rank in range(4)]
    if not diverge:
        assert texts == ["finished 6"] * 4
        return
    assert all(text.startswith("exit 2 after step ") for text in texts), texts
    lines = [line for line in capfd.readouterr().err.splitlines() if "replicas' parameters" in line]
    assert len(lines) == 4, lines
    for line in lines:
        assert "parameters of shard 1 differ after step 2 (equal after step 1)" in line, line


def test_the_carried_header_keeps_the_checksum_bits_exact() -> None:
    """Two ranks' payloads averaged as DDP does (sum / w): the decoded bits are the sums."""
    w = 2
    controls = []
    for checksum in (12345, 54321):
        control = np.zeros(control_header.CONTROL_SLOTS)
        control[4] = 1.0
        control[5:] = checksum_bits(checksum)
        controls.append(control)
    payloads = []
    for control in controls:
        payload = np.zeros(control_header.HEADER_SLOTS, dtype=np.float32)
        control_header.encode(payload, w, control)
        payloads.append(payload)
    averaged = (payloads[0] + payloads[1]) / np.float32(w)
    out = np.zeros(control_header.CONTROL_SLOTS)
    assert control_header.decode(averaged.tolist(), w, out)
    assert out[4] == 2
    assert list(out[5:]) == [a + b for a, b in zip(controls[0][5:], controls[1][5:], strict=True)]
    ddp = ReplicaLayout(replicas=w, shards=1, index=0)
    assert ddp.differing_parts(tuple(round(v) for v in out[5:])) == [0]
    same = np.array(checksum_bits(777)) * 2
    assert ddp.differing_parts(tuple(round(v) for v in same)) == []


def _summed(layouts: list[ReplicaLayout], checksums: list[int]) -> tuple[int, ...]:
    slots = [layout.slots(c) for layout, c in zip(layouts, checksums, strict=True)]
    return tuple(round(sum(column)) for column in zip(*slots, strict=True))


@pytest.mark.parametrize("replicas,shards", [(2, 2), (2, 4), (3, 2), (4, 8)])
def test_hsdp_slots_compare_each_shard_with_its_own_replicas_only(
    replicas: int, shards: int
) -> None:
    """HSDP's ranks send their bits weighed by their shard's digit: equal replicas of every shard
    read as equal though the shards differ from each other; one replica off names its shard."""
    layouts = [
        ReplicaLayout(replicas=replicas, shards=shards, index=i)
        for _ in range(replicas)
        for i in range(shards)
    ]  # rank r = replica r // shards of shard r % shards, as a (replicate, shard) mesh lays them
    shard_sums = [1000 + 7919 * layout.index for layout in layouts]  # each shard its own checksum
    assert layouts[0].differing_parts(_summed(layouts, shard_sums)) == []
    for off in (0, shards - 1):
        checksums = list(shard_sums)
        checksums[shards + off] += 1  # replica 1 of shard ``off`` updated differently
        assert all(
            layout.differing_parts(_summed(layouts, checksums)) == [off] for layout in layouts
        )


def test_one_word_changed_in_a_parameter_changes_the_bits() -> None:
    """A change in the high half of an int64 word (the second float32 of a pair) changes the
    carried bits: the checksum is folded (crc32), not cut to its low bits."""
    from elastic_trainer.state.training_state import state_checksum

    a = torch.zeros(4)
    b = a.clone()
    b[1] = 1.0
    assert checksum_bits(state_checksum([a])) != checksum_bits(state_checksum([b]))


@pytest.mark.parametrize("shape", [(0,), (1,), (3,), (1021,), (1022,), (2042,), (33, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_the_checksum_is_its_definition_on_every_length(shape: tuple[int, ...], dtype) -> None:
    """The fast weighted sum (one weight period, summed by column) is the definition: word ``i``
    weighs ``(i + 1) % 1021 + 1``, in wrapping int64, on lengths around the period."""
    from elastic_trainer.state.training_state import state_checksum

    tensor = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    data = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.to(torch.uint8)
    words = data.view(torch.int64) if data.numel() % 8 == 0 and data.numel() else data.long()
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64) % 1021 + 1
    expected = (int((words * weights).sum()) + words.numel()) & ((1 << 61) - 1)
    assert state_checksum(tensor) == expected
