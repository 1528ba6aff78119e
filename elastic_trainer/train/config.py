"""The :class:`~elastic_trainer.train.trainer.Trainer`'s configuration, as validated data.

Sections: :class:`DDPOptions` (the DDP wrapper) and
:class:`~elastic_trainer.checkpoint.config.CheckpointConfig` (read by the checkpoint manager).
Fields that also have an environment variable default to ``None``: the value given here wins,
else the variable (:mod:`elastic_trainer.runtime.settings`), else the default there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, TypedDict, get_args

from elastic_trainer.checkpoint.config import DEFAULT_CHECKPOINT_EVERY, CheckpointConfig
from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.runtime.settings import (
    WorkerSettings,
    check_bool,
    check_positive,
    check_positive_int,
)
from elastic_trainer.state.neighbour_copy import NeighbourCopyConfig

__all__ = [
    "DEFAULT_CHECKPOINT_EVERY",
    "CheckpointConfig",
    "DDPOptions",
    "FSDPOptions",
    "MixedPrecision",
    "RunConfig",
    "RunOptions",
    "TrainerConfig",
    "run_config_from",
]

MixedPrecision = Literal["no", "bf16", "fp16"]
_MIXED_PRECISION = ("no", "bf16", "fp16")


@dataclass(kw_only=True, slots=True)
class DDPOptions:
    """Options passed to ``DistributedDataParallel`` (see its documentation)."""

    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB: larger buckets mean fewer, bigger allreduces."""
    find_unused_parameters: bool = False
    """Only for models whose forward skips parameters; costs a graph traversal every step."""
    gradient_as_bucket_view: bool = False
    """Let gradients alias the allreduce buckets (saves one gradient-sized copy)."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers (BatchNorm statistics) at every forward."""
    static_graph: bool = False
    """Declare that the set of used parameters never changes between iterations. Every start then
    runs one throw-away synchronised pass (two on a resume): torch needs a static graph's first
    backward to synchronise, and gradient accumulation would start under ``no_sync``."""

    def __post_init__(self) -> None:
        check_positive("ddp.bucket_cap_mb", self.bucket_cap_mb)
        for name in (
            "find_unused_parameters",
            "gradient_as_bucket_view",
            "broadcast_buffers",
            "static_graph",
        ):
            check_bool(f"ddp.{name}", getattr(self, name))


@dataclass(kw_only=True, slots=True)
class FSDPOptions:
    """FSDP2 (``fully_shard``) for a model: each rank holds a shard of the parameters, gradients
    and optimizer state, and checkpoints are sharded (``docs/design/sharded.md``). Applied by
    :func:`apply_fsdp`."""

    blocks: tuple[str, ...] = ()
    """Module names sharded as their own units, in the order of ``named_modules``; ``*`` matches
    one name segment (``"blocks.*"`` is every child of ``blocks``, not their children). Then the
    whole model is one more unit. Each unit's parameters are gathered for its forward and backward
    only: name the repeated blocks (transformer layers)."""
    mixed_precision: MixedPrecision = "no"
    """``bf16`` / ``fp16``: parameters are cast to it for forward and backward, gradients are
    reduced in float32 (FSDP2's ``MixedPrecisionPolicy``); the sharded master copy stays float32."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (gathered again for the backward):
    less memory, one more all-gather per unit and step. ``False`` keeps them until the backward."""
    replicas: int = 1
    """HSDP: shard over a ``(replicas, world_size // replicas)`` mesh (``replicate`` x ``shard``):
    each shard lives on ``replicas`` ranks, which are its copies at a heal. 1: FSDP over every
    rank. Must divide the world size at every attempt."""

    def __post_init__(self) -> None:
        if isinstance(self.blocks, str) or not all(
            isinstance(b, str) and b.strip() for b in self.blocks
        ):
            raise ConfigError(
                f"fsdp.blocks: must be a sequence of module names, got {self.blocks!r}"
            )
        self.blocks = tuple(self.blocks)
        if self.mixed_precision not in get_args(MixedPrecision):
            raise ConfigError(
                f"fsdp.mixed_precision: must be one of {', '.join(get_args(MixedPrecision))}, "
                f"got {self.mixed_precision!r}"
            )
        check_bool("fsdp.reshard_after_forward", self.reshard_after_forward)
        check_positive_int("fsdp.replicas", self.replicas)


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """What a run is, whichever loop drives it: its data order and length, checkpoints, the stop
    and the collective timeout. :class:`~elastic_trainer.train.elastic.Elastic` takes these fields
    as keyword arguments (each default is written here once); :class:`TrainerConfig` extends it."""

    global_batch_size: int
    """Samples per optimizer step summed over all ranks; independent of the world size."""
    micro_batch_size: int | None = None
    """Most samples one rank puts through one forward; the rest of its share is accumulated
    (``no_sync``). ``None``: a rank's whole share in one forward."""
    seed: int = 0
    """Seeds the initial weights (identical on every rank), the data order and every step's random
    numbers."""
    epochs: int | None = None
    """Passes over the dataset. A pass is ``ceil(dataset size / global_batch_size)`` steps, the last
    one taking what is left (:attr:`Trainer.total_steps` gives the job's total for schedules).
    ``None`` (the default): as many as ``max_steps`` takes, or one without ``max_steps``."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in total, even mid-epoch. ``None``: run all epochs."""
    shuffle: bool = True
    """Shuffle the global order every epoch (seed + epoch), as ``DistributedSampler`` does."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Where and how often checkpoints are written (the checkpoint manager's section)."""
    sigterm_grace_s: float | None = None
    """After SIGTERM, seconds to finish the step and write the checkpoint before exiting.
    ``None``: ``ELASTIC_TRAINER_SIGTERM_GRACE_S``, default 30."""
    pg_timeout_s: float | None = None
    """Collective timeout of the process group. ``None``: ``ELASTIC_TRAINER_PG_TIMEOUT_S``, default
    30 minutes."""
    shard_copy: NeighbourCopyConfig | None = None
    """(A sharded model) each rank's shard is also kept on a neighbour rank, refreshed every
    ``shard_copy.every`` steps, so that a worker's failure costs at most ``every - 1`` steps
    (one more when the fault cuts the copy's transfer): under ``elastic-trainer run`` it heals in
    place from the copy; under plain torchrun the survivors write the dead rank's shards from it
    into the just-in-time checkpoint the restart resumes from. ``NeighbourCopyConfig(every=0)``:
    no copy, a heal reloads the newest checkpoint and a restart the newest periodic one.
    ``None``: ``ELASTIC_TRAINER_SHARD_COPY_EVERY``, default every step."""
    log_every: int = 10
    """Rank 0 logs a progress line every this many steps."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    record_samples_dir: str | None = None
    """Audit aid: every rank records every step's dataset indices here (``docs/own-loop.md``, audit)."""

    def __post_init__(self) -> None:
        check_positive_int("global_batch_size", self.global_batch_size)
        check_positive_int("micro_batch_size", self.micro_batch_size, allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed: must be a non-negative integer, got {self.seed!r}")
        if self.epochs is not None:
            check_positive_int("epochs", self.epochs)
        check_positive_int("max_steps", self.max_steps, allow_none=True)
        check_positive("sigterm_grace_s", self.sigterm_grace_s, allow_none=True)
        check_positive("pg_timeout_s", self.pg_timeout_s, allow_none=True)
        check_positive_int("log_every", self.log_every)
        if (
            isinstance(self.num_workers, bool)
            or not isinstance(self.num_workers, int)
            or self.num_workers < 0
        ):
            raise ConfigError(
                f"num_workers: must be a non-negative integer, got {self.num_workers!r}"
            )
        check_bool("shuffle", self.shuffle)
        if not isinstance(self.checkpoint, CheckpointConfig):
            raise ConfigError(
                f"checkpoint: must be a CheckpointConfig, got {type(self.checkpoint).__name__}"
            )
        if self.shard_copy is not None and not isinstance(self.shard_copy, NeighbourCopyConfig):
            raise ConfigError(
                f"shard_copy: must be a NeighbourCopyConfig, got {type(self.shard_copy).__name__}"
            )

    def sigterm_grace(self, settings: WorkerSettings) -> float:
        """The grace period in effect (this config's, else the environment's)."""
        return (
            self.sigterm_grace_s if self.sigterm_grace_s is not None else settings.sigterm_grace_s
        )

    def pg_timeout(self, settings: WorkerSettings) -> float:
        """The collective timeout in effect (this config's, else the environment's)."""
        return self.pg_timeout_s if self.pg_timeout_s is not None else settings.pg_timeout_s

    def to_dict(self) -> dict[str, Any]:
        """Plain-data copy (stored in checkpoints; loadable with ``weights_only=True``)."""
        return asdict(self)


class RunOptions(TypedDict, total=False):
    """:class:`RunConfig`'s fields as keyword arguments (``Elastic(model, data, **options)``): the
    names and types only; every default is :class:`RunConfig`'s (a unit test keeps both alike)."""

    global_batch_size: int
    micro_batch_size: int | None
    seed: int
    epochs: int | None
    max_steps: int | None
    shuffle: bool
    checkpoint: CheckpointConfig
    sigterm_grace_s: float | None
    pg_timeout_s: float | None
    shard_copy: NeighbourCopyConfig | None
    log_every: int
    num_workers: int
    record_samples_dir: str | None


@dataclass(kw_only=True, slots=True)
class TrainerConfig(RunConfig):
    """Everything the :class:`~elastic_trainer.train.trainer.Trainer` needs besides the model and
    data: the run (:class:`RunConfig`'s fields) and how the Trainer trains it."""

    grad_clip_norm: float | None = None
    """Clip the gradients' global 2-norm to this before every optimizer step (after unscaling with
    fp16). ``None``: no clipping."""
    eval_every: int | None = None
    """Call the job's ``evaluate`` every this many steps (and never when ``None``)."""
    backend: Literal["nccl", "gloo"] | None = None
    """Process-group backend; ``None``: NCCL on CUDA, gloo on CPU."""
    mixed_precision: MixedPrecision = "no"
    """``bf16`` autocast, or ``fp16`` autocast with a GradScaler (CUDA only)."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm (CUDA only: torch's SyncBatchNorm needs a GPU)."""
    zero_redundancy: bool = False
    """Shard optimizer state with ``ZeroRedundancyOptimizer``; consolidated on rank 0 to save (the
    just-in-time save is then off: no single survivor holds the sharded state)."""
    ddp: DDPOptions = field(default_factory=DDPOptions)
    """Options for the DDP wrapper (unused with ``fsdp``)."""
    fsdp: FSDPOptions | None = None
    """Shard the model with FSDP2 (``fully_shard`` on the blocks named, then the whole model)
    instead of replicating it under DDP: each rank holds a shard of the parameters, gradients and
    optimizer state, and checkpoints are sharded (every rank writes its own shards, a restart at
    another world size reshards). ``None``: DDP, unless the model factory returns a model it
    sharded itself, which is used as it is. See ``docs/design/sharded.md``."""

    def __post_init__(self) -> None:
        RunConfig.__post_init__(self)
        check_positive("grad_clip_norm", self.grad_clip_norm, allow_none=True)
        check_positive_int("eval_every", self.eval_every, allow_none=True)
        if self.backend not in (None, "nccl", "gloo"):
            raise ConfigError(f"backend: must be 'nccl', 'gloo' or unset, got {self.backend!r}")
        if self.mixed_precision not in _MIXED_PRECISION:
            raise ConfigError(
                f"mixed_precision: must be one of {', '.join(_MIXED_PRECISION)}, got {self.mixed_precision!r}"
            )
        for name in ("sync_batchnorm", "zero_redundancy"):
            check_bool(name, getattr(self, name))
        if not isinstance(self.ddp, DDPOptions):
            raise ConfigError(f"ddp: must be a DDPOptions, got {type(self.ddp).__name__}")
        if self.fsdp is not None:
            if not isinstance(self.fsdp, FSDPOptions):
                raise ConfigError(f"fsdp: must be an FSDPOptions, got {type(self.fsdp).__name__}")
            for name in ("sync_batchnorm", "zero_redundancy"):
                if getattr(self, name):
                    raise ConfigError(
                        f"{name}: not with fsdp (FSDP2 shards the optimizer state itself, and "
                        "SyncBatchNorm is a DDP feature)"
                    )
            if self.mixed_precision != "no":
                raise ConfigError(
                    "mixed_precision: with fsdp, set fsdp.mixed_precision (FSDP2's parameter "
                    "dtype for compute, float32 reduction) and leave mixed_precision 'no'"
                )


def run_config_from(
    config: RunConfig | None,
    options: Mapping[str, Any],
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
) -> RunConfig:
    """``Elastic``'s settings: ``config`` as given, or a :class:`RunConfig` of the keyword
    ``options`` (``checkpoint_dir`` / ``checkpoint_every``: short for ``checkpoint=``).

    Raises:
        ConfigError: an unknown or missing setting, both forms at once, or a bad value (one line).
    """
    shorthand = checkpoint_dir is not None or checkpoint_every is not None
    if config is not None:
        if options or shorthand:
            given = ", ".join(sorted([*options, *(["checkpoint_dir"] if shorthand else [])]))
            raise ConfigError(
                f"Elastic: config= holds the run's settings; pass {given} inside it, not beside it"
            )
        if not isinstance(config, RunConfig):
            raise ConfigError(f"config: must be a RunConfig, got {type(config).__name__}")
        return config
    known = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"Elastic({unknown[0]}=...): not a setting of the run; the settings are "
            f"{', '.join(sorted(known))} (RunConfig)"
        )
    if "global_batch_size" not in options:
        raise ConfigError("Elastic: global_batch_size= is required (samples per step, all ranks)")
    settings = dict(options)
    if shorthand:
        if "checkpoint" in settings:
            raise ConfigError(
                "Elastic: give checkpoint= or checkpoint_dir=/checkpoint_every=, not both"
            )
        every = checkpoint_every if checkpoint_every is not None else DEFAULT_CHECKPOINT_EVERY
        settings["checkpoint"] = CheckpointConfig(directory=checkpoint_dir, every=every)
    return RunConfig(**settings)
