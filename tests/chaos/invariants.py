"""What every chaos scenario must prove once the job has finished.

* **Exactly once**: the committed history (the steps that made it into the final model, from the
  runtime's per-rank sample records) has every step 1..N once, recorded by every rank of its
  world, and every sample index exactly once per epoch.
* **No checkpoint lost**: every checkpoint left verifies against its manifest, the last one is
  the final step, and every restart resumed from the newest checkpoint that was valid when it
  started (so no completed checkpoint was skipped; a deliberately damaged one is not valid).
* **Same weights**: bitwise equal to the no-fault run's when every step ran with the reference's
  world size. When the world size changed, bitwise equal to a *replay* -- a no-fault run that
  changes its world size at the same steps (each phase a one-node run that checkpoints every
  step and ends after its last step with ``CHAOS_EXIT_BEFORE_STEP``) -- and near the uninterrupted
  runs of the world sizes it went through: within :data:`WEIGHT_TOLERANCE` (relative L2 distance
  of all parameters) of the closest one, and a full-dataset loss within :data:`LOSS_TOLERANCE` of
  the range of theirs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import shutil
from collections.abc import Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.examples.synthetic_cnn import SmallCNN, SyntheticImages, evaluate
from elastic_trainer.runtime.sample_log import committed_history, read_records
from tests.chaos.chaos_job import EXIT_BEFORE_STEP_ENV
from tests.chaos.faults import DamageWindow, JobSpec, RunDirs, start_node, unique_run_id, wait_all

# When the world size changes mid-run the math changes with it: BatchNorm normalises over each
# rank's share of the batch (CPU has no SyncBatchNorm), and the gradient sum runs in another order.
# Measured on the chaos job (JobSpec defaults: 96 steps, cosine LR to 0, loss 2.30 -> ~1.95):
# uninterrupted runs with 1, 2, 3 ranks end with losses 1.931, 1.988, 2.028 and 0.16-0.24 apart
# (relative L2); no-fault replays that changed world size at steps 15-46 end 0.035-0.097 from the
# closest of them, losses inside their range. For 192 steps (the long schedule): 1 vs 2 ranks
# 1.344 vs 1.484, 0.244 apart; mixed runs 0.04-0.18 from the closest, losses inside the range.
# The bitwise replay is the exact check; these bounds catch a gross error (lost optimizer state,
# a repeated epoch) that a replay would share with the run it replays.
# Long schedules (700+ steps through many world sizes) end farther apart: seed 12345 with 50
# faults ended 0.30 and 0.32 from the fixed-size runs while bitwise equal to its replay, so the
# bound grows with the fixed-size runs' own spread (:func:`weight_tolerance`).
WEIGHT_TOLERANCE = 0.3
SPREAD_FACTOR = 1.5
LOSS_TOLERANCE = 0.1


@dataclass(frozen=True, slots=True)
class Generation:
    """One start of the worker group, from its ranks' ``start`` records."""

    started_unix: float
    resumed_step: int
    world_size: int
    source: str = "checkpoint"
    """``peer``: the group healed in place and took a live member's state, not a checkpoint."""


@dataclass(frozen=True, slots=True)
class RunSummary:
    """What a finished run did (for assertions and the test's printout)."""

    generations: list[Generation]
    worlds: list[int]
    """The world size of each committed step, in step order."""
    final_step: int
    checkpoints: list[int]
    model: dict[str, torch.Tensor]

    @property
    def world_phases(self) -> list[int]:
        return [w for i, w in enumerate(self.worlds) if i == 0 or self.worlds[i - 1] != w]


def summary_phases(worlds: list[int]) -> str:
    """``"2 x10, 1 x86"``: the world size of the committed steps, run-length encoded."""
    phases: list[list[int]] = []
    for world in worlds:
        if phases and phases[-1][0] == world:
            phases[-1][1] += 1
        else:
            phases.append([world, 1])
    return ", ".join(f"{w} x{n}" for w, n in phases)


def generations(samples: Path) -> list[Generation]:
    found: dict[str, Generation] = {}
    for records in read_records(samples):
        start = records[0]
        found.setdefault(
            start["generation"],
            Generation(
                start["started_unix"],
                start["resumed_step"],
                start["world_size"],
                start.get("source", "checkpoint"),
            ),
        )
    return sorted(found.values(), key=lambda g: g.started_unix)


def steps_lost(samples: Path) -> list[int]:
    """For each restart: steps the previous generation completed that the next one redid."""
    last: dict[str, int] = {}
    for records in read_records(samples):
        steps = [r["step"] for r in records if r["event"] == "done"]
        generation = records[0]["generation"]
        last[generation] = max([last.get(generation, 0), *steps])
    gens = {records[0]["generation"]: records[0] for records in read_records(samples)}
    order = sorted(gens, key=lambda g: gens[g]["started_unix"])
    return [
        max(0, last[prev] - gens[nxt]["resumed_step"]) for prev, nxt in itertools.pairwise(order)
    ]


def check_exactly_once(run: RunDirs, job: JobSpec) -> list[int]:
    """Assert the exactly-once properties; returns the world size of every committed step."""
    history = committed_history(read_records(run.samples))
    assert sorted(history) == list(range(1, job.steps + 1)), (
        f"committed steps are not 1..{job.steps}: missing {sorted(set(range(1, job.steps + 1)) - set(history))}, "
        f"extra {sorted(set(history) - set(range(1, job.steps + 1)))}"
    )
    for step, records in history.items():
        world = records[0]["world_size"]
        ranks = sorted(r["rank"] for r in records)
        assert ranks == list(range(world)), (
            f"step {step}: ranks {ranks} recorded it in a world of {world}"
        )
    for epoch in range(job.epochs):
        indices = [
            i
            for records in history.values()
            for r in records
            if r["epoch"] == epoch
            for i in r["indices"]
        ]
        duplicates = len(indices) - len(set(indices))
        assert sorted(indices) == list(range(job.dataset_size)), (
            f"epoch {epoch}: {len(indices)} samples consumed, {duplicates} twice, "
            f"{job.dataset_size - len(set(indices))} never"
        )
    return [history[s][0]["world_size"] for s in sorted(history)]


def check_checkpoints(
    run: RunDirs,
    job: JobSpec,
    gens: list[Generation],
    *,
    damaged: Set[int] = frozenset(),
    damage_windows: Sequence[DamageWindow] = (),
) -> list[int]:
    """Assert that no checkpoint was lost; returns the steps of the valid checkpoints.

    Args:
        damaged: steps whose checkpoints the scenario destroyed on purpose: they may fail
            verification (a restart that found a newer valid checkpoint never reads them; one
            that falls back past them sets them aside as ``*.corrupt``, which the scenario checks),
            and a later generation may write that step anew.
        damage_windows: for damaged checkpoints, when they were valid (written, then damaged): a
            restart in between rightly resumed from them.
    """
    manifests = {}
    for step in ckpt.iter_checkpoints(run.checkpoints):
        try:
            manifests[step] = ckpt.verify(run.checkpoints, step).manifest
        except ckpt.CheckpointError:
            if step not in damaged:
                raise
    steps = sorted(manifests)
    assert steps and steps[-1] == job.steps, (
        f"the last checkpoint is step {steps[-1] if steps else None}, not {job.steps}"
    )
    leftovers = [p.name for p in run.checkpoints.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    for gen in gens[1:]:
        before = [s for s, m in manifests.items() if m.created_unix < gen.started_unix]
        before += [
            w.step for w in damage_windows if w.created_unix < gen.started_unix < w.damaged_unix
        ]
        expected = max(before, default=0)
        if gen.source == "peer":  # healed in place: from the newest state a survivor held
            assert gen.resumed_step >= expected, (
                f"a heal at {gen.started_unix:.2f} went on from step {gen.resumed_step}, older than the newest "
                f"valid checkpoint then (step {expected})"
            )
            continue
        assert gen.resumed_step == expected, (
            f"a restart at {gen.started_unix:.2f} resumed from step {gen.resumed_step}, but the newest valid "
            f"checkpoint then was step {expected}"
        )
    return steps


def final_model(run: RunDirs) -> tuple[int, dict[str, torch.Tensor]]:
    steps = list(ckpt.iter_checkpoints(run.checkpoints))
    state = torch.load(ckpt.checkpoint_path(run.checkpoints, steps[-1]), weights_only=True)
    return int(state["step"]), state["model"]


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``|a - b| / |b|`` over every floating-point tensor, flattened together."""
    keys = [k for k in b if b[k].is_floating_point()]
    diff = math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in keys))
    norm = math.sqrt(sum(float(b[k].double().pow(2).sum()) for k in keys))
    return diff / norm


def weight_tolerance(fixed: dict[int, dict[str, torch.Tensor]]) -> float:
    """How far a run through these world sizes may end from the closest uninterrupted run of one.

    :data:`WEIGHT_TOLERANCE`, or :data:`SPREAD_FACTOR` times the largest distance between the
    uninterrupted runs themselves where that is more: a long run through several world sizes
    drifts from each of them about as far as they drift from one another (the summation-order
    differences compound with every step), so a fixed bound would fail long schedules for no
    error of the runtime.
    """
    spread = max(
        (relative_distance(a, b) for a, b in itertools.combinations(fixed.values(), 2)), default=0.0
    )
    return max(WEIGHT_TOLERANCE, SPREAD_FACTOR * spread)


def full_dataset_loss(model_state: dict[str, torch.Tensor], job: JobSpec) -> float:
    model = SmallCNN()
    model.load_state_dict(model_state)
    return evaluate(model, SyntheticImages(job.dataset_size, seed=job.seed), torch.device("cpu"))


def world_phases(worlds: list[int]) -> list[tuple[int, int]]:
    """``[(world size, last step of the phase), ...]`` from the world size of every step."""
    phases: list[tuple[int, int]] = []
    for step, world in enumerate(worlds, start=1):
        if phases and phases[-1][0] == world:
            phases[-1] = (world, step)
        else:
            phases.append((world, step))
    return phases


def phases_from_full_world(phases: list[int], full: int) -> list[int]:
    """The world sizes from the first world of ``full`` ranks on. What came before may only be a
    start with fewer ranks: on a busy machine a second launcher can join after the first round
    closed (its 1 s last call), a scale-up before any fault that :func:`check_run` holds too."""
    first = phases.index(full) if full in phases else len(phases)
    assert phases[:first] in ([], [1]), f"world sizes before the full world: {phases}"
    return phases[first:]


def assert_bitwise_equal(
    model: dict[str, torch.Tensor], other: dict[str, torch.Tensor], what: str
) -> None:
    assert model.keys() == other.keys()
    different = [name for name in model if not torch.equal(model[name], other[name])]
    assert not different, f"final weights differ from {what} in {different}"


class NoFaultRuns:
    """The no-fault runs a scenario is compared with, each run once per session.

    Args:
        endpoint: the etcd they rendezvous on.
        tmp: where their directories go.
    """

    def __init__(self, *, endpoint: str, tmp: Any) -> None:
        self._endpoint = endpoint
        self._tmp = tmp
        self._done: dict[tuple[JobSpec, tuple[tuple[int, int], ...]], RunDirs] = {}

    def fixed(self, job: JobSpec, world_size: int) -> RunDirs:
        """The uninterrupted run with ``world_size`` ranks."""
        return self.replay(job, [(world_size, job.steps)])

    def replay(self, job: JobSpec, phases: list[tuple[int, int]]) -> RunDirs:
        """A run through ``phases`` (see :func:`world_phases`): each phase a one-node run that
        ends after its last step, the next one resuming from that step's checkpoint.

        The first phase is taken from the fixed-size run of its world size (which checkpoints
        every step), so a replay costs one short run per world-size change.
        """
        # Neither timing nor checkpoints change the math.
        fast = dataclasses.replace(job, throttle_ms=0.0, checkpoint_every=1)
        key = (fast, tuple(phases))
        if key in self._done:
            return self._done[key]
        run = RunDirs.under(self._tmp.mktemp("no-fault"))
        if len(phases) > 1:
            first_world, first_last = phases[0]
            source = self.fixed(job, first_world).checkpoints
            run.checkpoints.mkdir()
            for path in (
                ckpt.checkpoint_path(source, first_last),
                ckpt.manifest_path(source, first_last),
            ):
                shutil.copy2(path, run.checkpoints / path.name)
            phases = phases[1:]
        for world, last in phases:
            env = {} if last == job.steps else {EXIT_BEFORE_STEP_ENV: str(last + 1)}
            node = start_node(
                name=f"to-{last}-w{world}",
                run=run,
                job=fast,
                endpoint=self._endpoint,
                run_id=unique_run_id("no-fault"),
                nnodes="1",
                nproc_per_node=world,
                max_restarts=0,
                env=env,
            )
            try:
                wait_all([node], timeout=180)
            finally:
                node.stop()
            assert list(ckpt.iter_checkpoints(run.checkpoints))[-1:] == [last], (
                f"the no-fault run did not end with a checkpoint of step {last}:\n{node.tail()}"
            )
        self._done[key] = run
        return run


def check_run(
    run: RunDirs,
    job: JobSpec,
    no_fault: NoFaultRuns,
    *,
    reference_world: int,
    damaged: Set[int] = frozenset(),
    damage_windows: Sequence[DamageWindow] = (),
) -> RunSummary:
    """Every invariant of the module docstring."""
    worlds = check_exactly_once(run, job)
    gens = generations(run.samples)
    steps = check_checkpoints(run, job, gens, damaged=damaged, damage_windows=damage_windows)
    step, model = final_model(run)
    ref_step, ref_model = final_model(no_fault.fixed(job, reference_world))
    assert step == ref_step == job.steps
    if set(worlds) == {reference_world}:
        assert_bitwise_equal(model, ref_model, f"the no-fault run's ({reference_world} ranks)")
    else:
        phases = world_phases(worlds)
        _, replay_model = final_model(no_fault.replay(job, phases))
        assert_bitwise_equal(
            model, replay_model, f"the no-fault replay's of the world sizes {phases}"
        )
        # A run through several world sizes must land near the uninterrupted runs of those sizes.
        fixed = {w: final_model(no_fault.fixed(job, w))[1] for w in sorted(set(worlds))}
        distances = {w: relative_distance(model, m) for w, m in fixed.items()}
        tolerance = weight_tolerance(fixed)
        losses = {w: full_dataset_loss(m, job) for w, m in fixed.items()}
        loss = full_dataset_loss(model, job)
        print(
            f"world sizes {summary_phases(worlds)}: relative L2 distance to the fixed-size runs {distances} "
            f"(tolerance {tolerance:.3f}); loss {loss:.4f}, theirs {losses} (tolerance {LOSS_TOLERANCE})"
        )
        assert min(distances.values()) <= tolerance, (
            f"final weights far from every fixed-size run: {distances} (tolerance {tolerance:.3f})"
        )
        assert (
            min(losses.values()) - LOSS_TOLERANCE <= loss <= max(losses.values()) + LOSS_TOLERANCE
        ), f"full-dataset loss {loss:.4f} outside the fixed-size runs' {losses} +- {LOSS_TOLERANCE}"
    return RunSummary(
        generations=gens, worlds=worlds, final_step=step, checkpoints=steps, model=model
    )


def describe(summary: RunSummary) -> dict[str, Any]:
    return {
        "generations": [(g.resumed_step, g.world_size) for g in summary.generations],
        "world_phases": summary.world_phases,
        "checkpoints": len(summary.checkpoints),
    }
