"""The routine comparison of the data-parallel replicas' parameters, on the step's control.

Each rank folds a checksum of its parameters into :data:`CHECK_BITS` bits and sends them in the
step's control slots, which are summed over the ranks. Under DDP every rank is a replica of the
whole model: a slot sums to 0 or the world size exactly when every rank sent the same bit. Under
HSDP (``R`` replicas of ``S`` shards) the ranks holding shard ``i`` compare with each other only:
each sends its bits times ``(R + 1) ** i``, so a summed slot read in base ``R + 1`` has one digit
per shard, the count of that shard's replicas whose bit was set, and each digit must be 0 or ``R``.
That is exact while ``(R + 1) ** S`` fits a float64 integer; HSDP's control goes on its own float64
collective (no carrier takes a 2-D mesh). Invariant: every rank takes its checksum after the same
steps and reads the same sums, so every rank raises :class:`ReplicasDivergedError` at the same step
or none does. Design, cost and blind spots: ``docs/design/own-loop.md``.
"""

from __future__ import annotations

import zlib

import torch
from torch.distributed.tensor import DTensor

from elastic_trainer.runtime import failures
from elastic_trainer.runtime.control_header import CHECK_BITS
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.step_control import ControlResult
from elastic_trainer.state.sharded import mesh_replicas
from elastic_trainer.state.training_state import TrainingState, state_checksum

EXACT_LIMIT = 1 << 52
"""Summed slots stay exact float64 integers below this: bounds ``(R + 1) ** S`` for HSDP."""


class ReplicasDivergedError(failures.DeterministicError):
    """The data-parallel replicas' parameters differ: state kept outside the run."""


def checksum_bits(checksum: int) -> list[float]:
    """The :data:`CHECK_BITS` bits a control carries of a parameter checksum (any int)."""
    folded = zlib.crc32(checksum.to_bytes(16, "little", signed=True))
    return [float((folded >> i) & 1) for i in range(CHECK_BITS)]


class ReplicaLayout:
    """Which ranks are replicas of each other, and how their check slots are weighed and read.

    ``replicas`` ranks hold each of ``shards`` parts of the model (DDP: the world, one part);
    this rank holds part ``index`` and weighs its bits by ``(replicas + 1) ** index``."""

    def __init__(self, *, replicas: int, shards: int, index: int) -> None:
        self.replicas, self.shards, self.index = replicas, shards, index
        self.base = replicas + 1

    @classmethod
    def of(cls, state: TrainingState, env: DistEnv) -> ReplicaLayout | None:
        """The layout of ``state``'s model in ``env``; ``None`` when nothing can be compared
        (one rank, FSDP's unreplicated shards, a layout other than DDP or HSDP, or an HSDP mesh
        whose slots would not stay exact)."""
        if env.world_size < 2 or state.model is None:
            return None
        if state.sharded is None:
            return cls(replicas=env.world_size, shards=1, index=0)
        replicas = mesh_replicas(state.model)
        if replicas < 2:
            return None
        shards = env.world_size // replicas
        if replicas * shards != env.world_size or (replicas + 1) ** shards >= EXACT_LIMIT:
            return None
        param = next(p for p in state.model.parameters() if isinstance(p, DTensor))
        return cls(replicas=replicas, shards=shards, index=param.device_mesh.get_local_rank(1))

    def slots(self, checksum: int) -> list[float]:
        """This rank's check slots for ``checksum``."""
        weight = float(self.base**self.index)
        return [bit * weight for bit in checksum_bits(checksum)]

    def differing_parts(self, sums: tuple[int, ...]) -> list[int]:
        """The parts whose replicas sent different bits, read from the summed slots."""
        parts: set[int] = set()
        for total in sums:
            for part in range(self.shards):
                total, count = divmod(total, self.base)
                if 0 < count < self.replicas:
                    parts.add(part)
        return sorted(parts)


def _local_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's parameters: its own shards of a sharded model."""
    return [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]


class ReplicaCheck:
    """Compares the replicas' parameters on the step's control: a checksum of this rank's
    parameters (its shards, under HSDP) after step ``S`` rides on step ``S+1``'s control, and the
    summed slots say whether every replica sent the same one. Due after the first two steps of
    every start (a fresh start, a resume, a heal) and every ``every`` steps; never for one rank,
    FSDP's unreplicated shards or ``every=0``. Design: ``docs/design/own-loop.md``."""

    def __init__(self, state: TrainingState, env: DistEnv, *, every: int) -> None:
        self._state, self._every = state, every
        self._layout = ReplicaLayout.of(state, env) if every > 0 else None
        self._first = 0
        self._equal_at: int | None = None
        self._ready: tuple[int, list[float]] | None = None

    def started(self, step: int) -> None:
        """This attempt's state is in place at ``step`` (loaded, taken from a peer, or fresh)."""
        self._first = step

    def after_update(self, step: int) -> None:
        """(every rank, after step ``step``'s update) take the checksum when it is due."""
        model = self._state.model
        if self._layout is None or model is None:
            return
        if step - self._first <= 2 or step % self._every == 0:
            checksum = state_checksum(_local_parameters(model))
            self._ready = (step, self._layout.slots(checksum))

    def take(self) -> tuple[int, list[float]] | None:
        """The check slots for the control being started, once."""
        ready, self._ready = self._ready, None
        return ready

    def compared(self, result: ControlResult) -> None:
        """Read a finished control's comparison; raises when the replicas differ."""
        if self._layout is None or result.check_sums is None or result.checksum_of is None:
            return
        step = result.checksum_of
        parts = self._layout.differing_parts(result.check_sums)
        if not parts:
            self._equal_at = step
            return
        since = (
            f"equal after step {self._equal_at}"
            if self._equal_at is not None
            else "not compared before in this attempt"
        )
        which = "" if self._layout.shards == 1 else f" of shard {', '.join(map(str, parts))}"
        raise ReplicasDivergedError(
            f"the replicas' parameters{which} differ after step {step} ({since}): state kept outside the run "
            "makes the ranks update differently; likely an own step counter driving the learning rate (use "
            "step.number), a per-rank random generator, or an optimizer/scheduler built after Elastic(...) or "
            "not in states="
        )
