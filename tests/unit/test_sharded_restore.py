"""Where each shard comes from at a heal of sharded state (``plan_restore``: pure, branch by
branch): the FSDP ring's neighbour copy, a rank's own staged copy, an HSDP replica, and the
fallback to the checkpoint when every copy of a shard is gone."""

from __future__ import annotations

from elastic_trainer.heal.sharded_restore import RestorePlan, Source, plan_restore
from elastic_trainer.state.neighbour_copy import (
    NO_STATE,
    Holdings,
    holder_of,
    neighbour_of,
    ring_stride,
)


def fsdp(
    rank: int,
    live: int,
    *,
    world: int = 3,
    own: tuple[int, ...] = (),
    copies: tuple[int, ...] = (),
    every: int = 1,
) -> Holdings:
    """What rank ``rank`` of an FSDP ring holds: its neighbour's copies at ``copies`` steps."""
    neighbour = neighbour_of(rank, world)
    return Holdings(
        rank=rank,
        world_size=world,
        replicas=1,
        live=live,
        own=own,
        copies=tuple((neighbour, s) for s in copies),
        every=every,
    )


def test_the_ring() -> None:
    assert [neighbour_of(r, 3) for r in range(3)] == [1, 2, 0]
    assert [holder_of(r, 3) for r in range(3)] == [2, 0, 1]
    assert neighbour_of(0, 2) == holder_of(0, 2) == 1


def test_the_ring_crosses_nodes_so_a_lost_node_loses_no_shard() -> None:
    """2 nodes x 2 ranks: the copies live on the other node (stride 2), so node b's loss (ranks
    2 and 3) is healed from node a's copies with no step redone. A ring of stride 1 keeps rank
    3's copy on rank 2, on the same node: that loss falls back to the checkpoint."""
    assert (ring_stride(4, 2), ring_stride(3, 3), ring_stride(6, 4), ring_stride(8, 1)) == (
        2,
        1,
        1,
        1,
    )
    assert [neighbour_of(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    assert [holder_of(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]

    def node_a(stride: int) -> list[Holdings | None]:
        return [
            Holdings(rank=r, world_size=4, replicas=1, live=7, own=(6, 7), stride=stride,
                     copies=((neighbour_of(r, 4, stride), 6), (neighbour_of(r, 4, stride), 7)))
            for r in (0, 1)
        ] + [None, None]  # fmt: skip

    plan = plan_restore(node_a(2), 4)
    assert plan.step == 7 and plan.redone == 0
    assert plan.sources == (
        Source(0, "live"),
        Source(1, "live"),
        Source(0, "copy"),
        Source(1, "copy"),
    )
    old = plan_restore(node_a(1), 4)
    assert old.step is None and old.reason == "rank 3's shard and its copy on rank 2 are gone"


def test_a_lost_rank_comes_from_its_neighbour_copy_with_no_step_redone() -> None:
    members = [fsdp(0, 7, own=(6, 7), copies=(6, 7)), None, fsdp(2, 7, own=(6, 7), copies=(6, 7))]
    plan = plan_restore(members, 3)
    assert plan.step == 7 and plan.redone == 0
    assert plan.sources == (Source(0, "live"), Source(0, "copy"), Source(2, "live"))
    assert "rank 1's from rank 0's neighbour copy" in plan.describe()
    assert "0 step(s) redone" in plan.describe()


def test_a_copy_cut_by_the_fault_falls_back_a_generation_and_everyone_goes_back() -> None:
    """Rank 0's copy of rank 1's step 7 never arrived whole: it holds step 6, and so does every
    survivor's own staged shard: step 6 for all, one step redone."""
    members = [fsdp(0, 7, own=(6, 7), copies=(5, 6)), None, fsdp(2, 7, own=(6, 7), copies=(6, 7))]
    plan = plan_restore(members, 3)
    assert plan.step == 6 and plan.redone == 1
    assert plan.sources == (Source(0, "own"), Source(0, "copy"), Source(2, "own"))


def test_an_interval_redoes_the_steps_since_the_copy_and_says_so() -> None:
    members = [
        fsdp(0, 10, own=(4, 8), copies=(4, 8), every=4),
        None,
        fsdp(2, 10, own=(4, 8), copies=(4, 8), every=4),
    ]
    plan = plan_restore(members, 3)
    assert plan.step == 8 and plan.redone == 2
    assert "2 step(s) redone (the copy is refreshed every 4 steps)" in plan.describe()


def test_survivors_a_step_apart_meet_at_the_older_one() -> None:
    """A rank that finished the step the others did not goes back to its staged copy of the
    step before."""
    members = [fsdp(0, 8, own=(7, 8), copies=(7, 8)), None, fsdp(2, 7, own=(6, 7), copies=(6, 7))]
    plan = plan_restore(members, 3)
    assert plan.step == 7
    assert plan.sources[0] == Source(0, "own") and plan.sources[2] == Source(2, "live")


def test_two_neighbours_lost_together_fall_back_to_the_checkpoint() -> None:
    """Ranks 1 and 2 die: rank 1's copy (on rank 0) survives, rank 2's (on rank 1) does not."""
    members = [fsdp(0, 7, own=(6, 7), copies=(6, 7)), None, None]
    plan = plan_restore(members, 3)
    assert plan.step is None and plan.newest == 7
    assert plan.reason == "rank 2's shard and its copy on rank 1 are gone"
    assert "no copy of every shard survived" in plan.describe()


def test_two_ranks_that_are_not_neighbours_heal_in_place() -> None:
    members = [
        None,
        fsdp(1, 7, own=(7,), copies=(7,), world=4),
        None,
        fsdp(3, 7, own=(7,), copies=(7,), world=4),
    ]
    plan = plan_restore(members, 4)
    assert plan.step == 7
    assert plan.sources == (
        Source(3, "copy"),
        Source(1, "live"),
        Source(1, "copy"),
        Source(3, "live"),
    )


def test_with_the_copy_off_a_lost_rank_means_the_checkpoint() -> None:
    members = [fsdp(0, 7, every=0), None, fsdp(2, 7, every=0)]
    plan = plan_restore(members, 3)
    assert plan.step is None and plan.reason == "the shard copy is off"


def test_nobody_lost_keeps_every_shard_where_it_is() -> None:
    members = [fsdp(0, 7, every=0), fsdp(1, 7, every=0), fsdp(2, 7, every=0)]
    plan = plan_restore(members, 3)
    assert plan.step == 7 and all(s == Source(r, "live") for r, s in enumerate(plan.sources))


def hsdp(rank: int, live: int) -> Holdings:
    """A 2 x 2 mesh (replicate x shard): ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1."""
    return Holdings(rank=rank, world_size=4, replicas=2, live=live, every=0)


def test_hsdp_a_lost_shard_comes_from_its_replica() -> None:
    assert [hsdp(r, 0).shard for r in range(4)] == [0, 1, 0, 1]
    plan = plan_restore([hsdp(0, 9), None, hsdp(2, 9), hsdp(3, 9)], 4)
    assert plan.step == 9 and plan.redone == 0
    assert plan.sources[1] == Source(3, "live")


def test_hsdp_both_replicas_of_a_shard_lost_fall_back() -> None:
    plan = plan_restore([hsdp(0, 9), None, hsdp(2, 9), None], 4)
    assert plan.step is None
    assert plan.reason == "every replica of shard 1 (ranks 1, 3) is gone"


def ring(rank: int, live: int, *, world: int, stride: int, steps: tuple[int, ...]) -> Holdings:
    """Old rank ``rank`` of a ring of ``world`` ranks: its own staged and its neighbour's copies."""
    neighbour = neighbour_of(rank, world, stride)
    return Holdings(rank=rank, world_size=world, replicas=1, live=live, own=steps,
                    copies=tuple((neighbour, s) for s in steps), stride=stride)  # fmt: skip


def test_a_lost_node_reshards_in_place_from_its_copies_on_the_survivors() -> None:
    """2 nodes x 2 ranks, node b lost for good (elastic 4 -> 2): node a's ranks, now 0 and 1, hold
    their own shards and node b's copies (stride 2); every old shard exists at step 7."""
    members = [ring(r, 7, world=4, stride=2, steps=(6, 7)) for r in (0, 1)]
    plan = plan_restore(members, 2)
    assert (plan.step, plan.redone, plan.old_world, plan.new_world) == (7, 0, 4, 2)
    assert plan.sources == (
        Source(0, "live"),
        Source(1, "live"),
        Source(0, "copy"),
        Source(1, "copy"),
    )
    assert RestorePlan.from_json(plan.to_json()) == plan
    assert plan.describe() == (
        "shards of step 7 resharded in place from 4 to 2 ranks (old rank 0's from rank 0's live "
        "state; old rank 1's from rank 1's live state; old rank 2's from rank 0's neighbour copy; "
        "old rank 3's from rank 1's neighbour copy): 0 step(s) redone"
    )


def test_survivors_renumbered_take_their_old_shards_from_their_new_ranks() -> None:
    """Node a lost (old ranks 0, 1): node b's ranks 2 and 3 are now ranks 0 and 1; the copies
    of old 0 and 1 are on them. A step cut short on one survivor goes back to its staged copy."""
    members = [ring(2, 9, world=4, stride=2, steps=(8, 9)), ring(3, NO_STATE, world=4, stride=2,
               steps=(8, 9))]  # fmt: skip
    plan = plan_restore(members, 2)
    assert (plan.step, plan.redone) == (9, 0)
    assert plan.sources == (Source(0, "copy"), Source(1, "copy"), Source(0, "live"),
                            Source(1, "own"))  # fmt: skip


def test_a_node_joining_reshards_the_live_shards_onto_more_ranks() -> None:
    """2 -> 4: the old ranks keep 0 and 1, the newcomers hold nothing; their live shards do,
    with the copy off as well."""
    for every in (1, 0):
        members = [fsdp(0, 20, world=2, every=every), fsdp(1, 20, world=2, every=every), None, None]
        plan = plan_restore(members, 4)
        assert (plan.step, plan.old_world, plan.new_world, plan.redone) == (20, 2, 4, 0)
        assert plan.sources == (Source(0, "live"), Source(1, "live"))
    # 4 -> 5, old ranks 0..2 survive in another order: old 3's shard is old 2's neighbour copy
    whole = [None, None, ring(1, 5, world=4, stride=1, steps=(5,)), ring(2, 5, world=4, stride=1,
             steps=(5,)), ring(0, 5, world=4, stride=1, steps=(5,))]  # fmt: skip
    assert plan_restore(whole, 5).sources == (
        Source(4, "live"), Source(2, "live"), Source(3, "live"), Source(3, "copy"))  # fmt: skip


def test_survivors_renumbered_at_the_same_size_reshard_in_place() -> None:
    """Same size, other places (a replacement took rank 0 and a survivor moved): the shards move
    to their new ranks in memory (tests/unit/test_renumbered_reshard.py runs it). With old rank
    2 lost and its copy on it, the renumbering falls back, saying so."""
    swapped = [fsdp(2, 5, world=4), fsdp(1, 5, world=4), fsdp(0, 5, world=4), fsdp(3, 5, world=4)]
    plan = plan_restore(swapped, 4)
    assert (plan.step, plan.old_world, plan.new_world, plan.redone) == (5, 4, 4, 0)
    assert plan.sources == (
        Source(2, "live"), Source(1, "live"), Source(0, "live"), Source(3, "live"))  # fmt: skip
    replaced = [None, None, fsdp(1, 5, world=4, copies=(5,)), fsdp(0, 5, world=4, copies=(5,))]
    assert plan_restore(replaced, 4).reason == (
        "survivors were renumbered, and rank 3's shard and its copy on rank 2 are gone"
    )


def test_hsdp_reshards_over_its_shard_dim_when_the_world_size_changes() -> None:
    """2 x 2 (replicate x shard) loses the node of ranks 2 and 3 (replica 1): ranks 0 and 1 hold
    shards 0 and 1, cut into 2 x 1 (every rank the whole, twice); a node joining 2 x 1 -> 2 x 2
    takes shard 0 from either replica."""
    plan = plan_restore([hsdp(0, 9), hsdp(1, 9)], 2)
    assert (plan.step, plan.old_world, plan.new_world, plan.replicas) == (9, 4, 2, 2)
    assert (plan.old_shards, plan.new_shards, plan.redone) == (2, 1, 0)
    assert plan.sources == (Source(0, "live"), Source(1, "live"))
    assert "(HSDP: 2 x 2 -> 2 x 1)" in plan.describe()
    grown = [Holdings(rank=r, world_size=2, replicas=2, live=4, every=0) for r in (0, 1)]
    plan = plan_restore([*grown, None, None], 4)
    assert (plan.step, plan.old_shards, plan.new_shards) == (4, 1, 2)
    assert plan.sources == (Source(0, "live"),)


def test_a_reshard_falls_back_when_a_shard_is_gone_or_the_mesh_is_hsdp() -> None:
    # 4 -> 2 with a ring of stride 1: old rank 3's copy was on rank 2, on the lost node
    plan = plan_restore([ring(r, 7, world=4, stride=1, steps=(7,)) for r in (0, 1)], 2)
    assert plan.step is None and plan.redone == 0
    assert plan.reason == (
        "the world changed from 4 to 2 ranks, and rank 3's shard and its copy on rank 2 are gone"
    )
    assert plan_restore([fsdp(0, 7, world=2), None, None], 3).reason == (
        "the world changed from 2 to 3 ranks, and rank 1's shard and its copy on rank 0 are gone"
    )
    hsdp_odd = [hsdp(0, 9), hsdp(1, 9), None]
    assert plan_restore(hsdp_odd, 3).reason == (
        "the world changed from 4 to 3 ranks, and 3 ranks do not make 2 replicas of the shards"
    )
    assert plan_restore([hsdp(0, 9), hsdp(2, 9)], 2).reason == (
        "the world changed from 4 to 2 ranks, and every replica of shard 1 (ranks 1, 3) is gone"
    )
    mixed = [fsdp(0, 7, world=2), fsdp(1, 7, world=3)]
    assert plan_restore(mixed, 2).reason == "the survivors held shards of 2 and 3 ranks"
    twice = [fsdp(0, 7, world=2), fsdp(0, 7, world=2), None]
    assert plan_restore(twice, 3).reason == (
        "the world changed from 2 to 3 ranks, and the survivors' old ranks [0, 0] do not fit"
    )
    off = [fsdp(r, 7, world=4, every=0) for r in (0, 1)]
    assert plan_restore(off, 2).reason == (
        "the world changed from 4 to 2 ranks, and the shard copy is off"
    )


def test_a_survivor_without_a_completed_step_is_no_source() -> None:
    """An update that did not complete leaves the live state at no step: only staged copies count."""
    members = [fsdp(0, NO_STATE, own=(6,), copies=(6,)), None, fsdp(2, 6, own=(6,), copies=(6,))]
    plan = plan_restore(members, 3)
    assert plan.step == 6 and plan.sources[0] == Source(0, "own")


def test_the_plan_travels_as_json() -> None:
    plan = plan_restore([fsdp(0, 7, own=(7,), copies=(7,)), None, fsdp(2, 7)], 3)
    assert RestorePlan.from_json(plan.to_json()) == plan


def test_the_reason_names_only_the_shards_with_no_copy_at_any_step() -> None:
    """Ranks 1 and 2 die just after step 13: rank 0 holds rank 1's copy of step 12 only (13's was
    on its way), rank 2's only copy was on rank 1. Only rank 2's shard is gone."""
    members = [fsdp(0, 13, own=(12, 13), copies=(11, 12)), None, None]
    plan = plan_restore(members, 3)
    assert plan.step is None
    assert plan.reason == "rank 2's shard and its copy on rank 1 are gone"


def test_copies_of_no_common_step_say_so() -> None:
    members = [fsdp(0, 13, own=(13,), copies=(11,)), None, fsdp(2, 13, own=(13,), copies=(12,))]
    plan = plan_restore(members, 3)
    assert plan.step is None
    assert plan.reason == "no step at which every shard survived (the newest held: 13)"


def test_resume_takes_the_restored_shards_else_the_checkpoint_and_counts_the_redone_steps(
    caplog,
) -> None:
    from elastic_trainer.state.restore_plan import RESTORE, resume_sharded

    loads: list[str] = []

    def load() -> int:
        loads.append("checkpoint")
        return 10

    restored = plan_restore([fsdp(0, 13, own=(13,), copies=(13,)), None, fsdp(2, 13)], 3)
    payload = {"step": 13}
    assert resume_sharded(None, restore=lambda p: -1, load=load, rank=0) == 10
    assert (
        resume_sharded(
            {RESTORE: restored.to_json(), "payload": payload},
            restore=lambda p: int(p["step"]),
            load=load,
            rank=0,
        )
        == 13
    )
    assert loads == ["checkpoint"]
    lost = plan_restore([fsdp(0, 13, own=(13,), copies=(12,)), None, None], 3)
    with caplog.at_level("WARNING"):
        step = resume_sharded(
            {RESTORE: lost.to_json(), "payload": None}, restore=lambda p: -1, load=load, rank=0
        )
    assert step == 10 and loads == ["checkpoint", "checkpoint"]
    assert (
        "heal: no copy of every shard survived (rank 2's shard and its copy on rank 1 are gone): "
        "every rank resumed from the newest checkpoint (step 10): 3 step(s) redone"
    ) in caplog.text


def test_hsdp_replicas_a_step_apart_meet_at_the_older_one() -> None:
    """Rank 1 died between its shard group's reduce-scatter and its replicate group's all-reduce:
    ranks 0 and 2 finished step 8, rank 3 (rank 1's replica) did not. Ranks 0 and 2 go back to
    their own staged step 7, rank 1's shard is rank 3's live step 7."""
    members = [
        Holdings(rank=0, world_size=4, replicas=2, live=8, own=(7, 8)),
        None,
        Holdings(rank=2, world_size=4, replicas=2, live=8, own=(7, 8)),
        Holdings(rank=3, world_size=4, replicas=2, live=7, own=(6, 7)),
    ]
    plan = plan_restore(members, 4)
    assert plan.step == 7 and plan.redone == 1
    assert plan.sources == (
        Source(0, "own"),
        Source(3, "live"),
        Source(2, "own"),
        Source(3, "live"),
    )
