"""Unit tests of the elastic sampler: order, partitioning, exactly-once across world-size changes."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DistributedSampler

from elastic_trainer.runtime.sampler import ElasticSampler, MicroBatchSampler, split_evenly

pytestmark = pytest.mark.timeout(60)


def _consume_epoch(sampler: ElasticSampler, world_sizes: list[int]) -> list[int]:
    """Run one epoch, switching world size after every step; return indices in consumption order."""
    consumed: list[int] = []
    step = 0
    while not sampler.epoch_done:
        world = world_sizes[step % len(world_sizes)]
        plans = [sampler.plan(sampler.cursor, rank, world) for rank in range(world)]
        for plan in plans:
            consumed.extend(plan.indices)
        sampler.advance(plans[0])
        step += 1
    return consumed


def test_order_matches_distributed_sampler_permutation() -> None:
    sampler = ElasticSampler(50, 8, seed=7)
    reference = DistributedSampler(list(range(50)), num_replicas=1, rank=0, shuffle=True, seed=7)
    for epoch in (0, 3):
        sampler.set_epoch(epoch)
        reference.set_epoch(epoch)
        assert sampler.order() == list(reference)


def test_unshuffled_order_is_dataset_order() -> None:
    assert ElasticSampler(10, 3, shuffle=False).order() == list(range(10))


@pytest.mark.parametrize(
    "size,batch,micro", [(100, 16, None), (101, 16, 3), (37, 40, None), (64, 7, 2), (5, 8, 1)]
)
def test_every_sample_exactly_once_per_epoch_across_world_size_changes(
    size: int, batch: int, micro: int | None
) -> None:
    rng = random.Random(size * 1000 + batch)
    sampler = ElasticSampler(size, batch, seed=3, micro_batch_size=micro)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        worlds = [rng.randint(1, 6) for _ in range(10)]
        consumed = _consume_epoch(sampler, worlds)
        assert sorted(consumed) == list(range(size)), f"epoch {epoch} with worlds {worlds}"
        assert consumed == sampler.order(epoch)  # and in the global order


def test_a_steps_samples_do_not_depend_on_world_size() -> None:
    sampler = ElasticSampler(200, 24, seed=1)
    sampler.set_epoch(2)
    for cursor in (0, 24, 192):
        sets = []
        for world in (1, 2, 3, 5, 7):
            plans = [sampler.plan(cursor, r, world) for r in range(world)]
            assert {p.global_samples for p in plans} == {min(24, 200 - cursor)}
            sets.append(sorted(i for p in plans for i in p.indices))
        assert all(s == sets[0] for s in sets)


def test_shares_are_even_and_micro_steps_equal_on_every_rank() -> None:
    sampler = ElasticSampler(1000, 50, micro_batch_size=4)
    plans = [sampler.plan(0, r, 3) for r in range(3)]
    assert [p.samples for p in plans] == [17, 17, 16]
    assert len({len(p.micro_batches) for p in plans}) == 1
    assert all(len(mb.indices) <= 4 for p in plans for mb in p.micro_batches)


def test_short_tail_step_pads_empty_ranks_with_zero_weight() -> None:
    sampler = ElasticSampler(10, 8, shuffle=False)  # tail step has 2 samples
    plans = [sampler.plan(8, r, 4) for r in range(4)]
    assert [p.samples for p in plans] == [1, 1, 0, 0]
    padding = plans[3].micro_batches[0]
    assert padding.samples == 0 and len(padding.indices) == 1
    assert plans[3].indices == []


def test_plan_is_a_pure_function() -> None:
    a = ElasticSampler(300, 32, seed=5, micro_batch_size=5)
    b = ElasticSampler(300, 32, seed=5, micro_batch_size=5)
    a.set_epoch(4)
    b.order(1)  # a cached order of another epoch must not leak
    b.set_epoch(4)
    assert a.plan(64, 2, 3) == b.plan(64, 2, 3)


def test_state_round_trip_and_set_epoch_semantics() -> None:
    sampler = ElasticSampler(100, 10)
    sampler.set_epoch(1)
    sampler.advance(sampler.plan(0, 0, 2))
    state = sampler.state_dict()
    assert state == {"epoch": 1, "cursor": 10}
    restored = ElasticSampler(100, 10)
    restored.load_state_dict(state)
    restored.set_epoch(1)  # same epoch: keeps the resumed cursor
    assert restored.cursor == 10
    restored.set_epoch(2)  # a new epoch starts at its beginning
    assert restored.cursor == 0


def test_advance_rejects_a_plan_that_is_not_next() -> None:
    sampler = ElasticSampler(100, 10)
    plan = sampler.plan(10, 0, 1)
    with pytest.raises(RuntimeError, match="not the next step"):
        sampler.advance(plan)


def test_invalid_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="dataset_size"):
        ElasticSampler(0, 1)
    with pytest.raises(ValueError, match="global_batch_size"):
        ElasticSampler(10, 0)
    with pytest.raises(ValueError, match="rank 3 is not in a world of 2"):
        ElasticSampler(10, 2).plan(0, 3, 2)
    with pytest.raises(ValueError, match="sampler state out of range"):
        ElasticSampler(10, 2).load_state_dict({"epoch": 0, "cursor": 11})


def test_micro_batch_sampler_feeds_the_plans_in_order() -> None:
    sampler = ElasticSampler(40, 12, micro_batch_size=2)
    sampler.set_epoch(1)
    sampler.advance(sampler.plan(0, 0, 3))
    flattened = [list(mb.indices) for p in sampler.plans(1, 3) for mb in p.micro_batches]
    batches = list(MicroBatchSampler(sampler, 1, 3))
    assert batches == flattened and len(batches) == len(MicroBatchSampler(sampler, 1, 3))
    loader = torch.utils.data.DataLoader(
        list(range(40)), batch_sampler=MicroBatchSampler(sampler, 1, 3)
    )
    assert [b.tolist() for b in loader] == flattened


def test_split_evenly() -> None:
    assert split_evenly(10, 4) == [3, 3, 2, 2]
    assert split_evenly(2, 4) == [1, 1, 0, 0]


def test_a_dataset_smaller_than_the_global_batch_is_said_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """40 samples, a global batch of 64: every step is the whole dataset (a new user's trial: it
    trained on silently, one epoch per step). Said once, at the sampler's creation."""
    with caplog.at_level("WARNING", logger="elastic_trainer.runtime.sampler"):
        small = ElasticSampler(40, global_batch_size=64, seed=0)
        ElasticSampler(64, global_batch_size=64, seed=0)  # a dataset of one full step: nothing
    (line,) = [r.getMessage() for r in caplog.records]
    assert "40 samples, fewer than global_batch_size 64" in line, line
    assert len(small) == 1 and small.plan(0, rank=0, world_size=1).global_samples == 40
