"""The move of a reshard in place (``heal/shard_move.py`` through ``restore_shards``) over three
real gloo processes: old world 2, new world 3 (a node joining). New rank 0 holds old shard 0
live, new rank 1 old shard 1 as its staged copy only, new rank 2 is a newcomer holding nothing;
each rank ends with exactly ``torch.chunk`` of the full tensors at 3 ranks (model and AdamW
state), the plan says so, and a layout that cannot be resharded makes every rank fall back
together with the same one-line reason."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_trainer.heal.sharded_restore import RESTORE, RestorePlan, restore_shards
from elastic_trainer.state.local_shards import LAYOUT, SHARD
from elastic_trainer.state.neighbour_copy import Holdings
from tests.unit.test_reshard import _chunk, _full_state, _payload

OLD, NEW, STEP = 2, 3, 12


class _Holder:
    """What a survivor's neighbour copy answers at a heal (``ShardHolder``), from fixed payloads."""

    def __init__(self, old_rank: int, what: str, *, placement: str | None = None) -> None:
        self.step = STEP
        self.old_rank, self.what = old_rank, what
        self.payload_of = _payload(_full_state(), OLD, old_rank)
        if placement is not None:  # a layout the reshard must refuse
            for key in self.payload_of[LAYOUT]:
                self.payload_of[LAYOUT][key][1] = placement
        self.asked: list[tuple[str, int, int]] = []

    def holdings(self) -> Holdings:
        live = STEP if self.what == "live" else -1
        return Holdings(rank=self.old_rank, world_size=OLD, replicas=1, live=live, own=(STEP,))

    def payload(self, what: str, *, shard: int, step: int) -> dict[str, Any]:
        self.asked.append((what, shard, step))
        assert (what, shard, step) == (self.what, self.old_rank, STEP)
        return self.payload_of


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _worker(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=NEW)
    heal_log, seen = logging.getLogger("elastic_trainer.heal"), _Records()
    heal_log.setLevel(logging.DEBUG)
    heal_log.addHandler(seen)
    try:
        holder = [_Holder(0, "live"), _Holder(1, "own"), None][rank]
        state = restore_shards(holder, rank=rank, world_size=NEW)
        assert state is not None
        # The shard moves are no full-state (DDP) transfers: each at DEBUG only, and rank 0 says
        # once what moved (every rank logged "state of step 12 from rank 0: 0.0 MB" lines).
        lines = [(r.levelno, r.getMessage()) for r in seen.records]
        transfers = [level for level, line in lines if line.startswith("heal: state of step")]
        assert transfers and set(transfers) == {logging.DEBUG}, lines
        summary = [line for level, line in lines if level >= logging.INFO]
        if rank == 0:
            assert len(summary) == 1 and re.search(
                r"; moved 2 shard\(s\), \d+\.\d MB \(", summary[0]
            ), summary
        else:
            assert summary == [], summary
        plan = RestorePlan.from_json(state[RESTORE])
        assert (plan.step, plan.old_world, plan.new_world, plan.redone) == (STEP, OLD, NEW, 0)
        payload = state["payload"]
        full = _full_state()
        for name, tensor in full.items():
            assert torch.equal(payload["model"][name][SHARD], _chunk(tensor, NEW, rank)), name
        want = _payload(full, NEW, rank)["optimizers"][0]["state"]
        got = payload["optimizers"][0]["state"]
        for index, entry in want.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[index][key][SHARD], entry[key][SHARD]), (index, key)
        assert payload["objects"] == {"sampler": {"epoch": 1, "cursor": 240}}
        # another placement (a 2-D mesh): every rank falls back, with the same reason
        odd = "(2, 2) (Replicate(), Shard(dim=0))"
        holder = [_Holder(0, "live", placement=odd), _Holder(1, "own", placement=odd), None][rank]
        state = restore_shards(holder, rank=rank, world_size=NEW)
        assert state is not None and state["payload"] is None
        refused = RestorePlan.from_json(state[RESTORE])
        assert refused.step is None and refused.reason == (
            "the shards cannot be resharded in place (model.embedding.weight is placed "
            f"{odd}, not on dim 0 of a 1-D mesh)"
        )
        Path(out, f"ok-{rank}").touch()
    finally:
        dist.destroy_process_group()


def test_a_join_reshards_the_live_and_staged_shards_onto_three_ranks(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # forkserver: the ranks fork from a fresh server (no OpenMP pool of this process to inherit)
    # and do not import torch once each as spawn does (4-7 s instead of 40 on a loaded machine)
    mp.start_processes(
        _worker,
        args=(str(tmp_path / "store"), str(tmp_path)),
        nprocs=NEW,
        start_method="forkserver",
    )
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == [f"ok-{r}" for r in range(NEW)]
