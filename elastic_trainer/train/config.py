"""Configuration of the training runtime, as validated data.

Precedence for every value that also has an environment variable: explicit argument > environment
variable > default. The environment variables are the named constants below, nowhere else.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from elastic_trainer.runtime.failures import DeterministicError

ENV_SIGTERM_GRACE_S = "ELASTIC_TRAINER_SIGTERM_GRACE_S"
"""Seconds between SIGTERM and exit in which rank 0 writes its final checkpoint."""

ENV_PG_TIMEOUT_S = "ELASTIC_TRAINER_PG_TIMEOUT_S"
"""Process-group (collective) timeout in seconds."""

ENV_JIT_SAVE = "ELASTIC_TRAINER_JIT_SAVE"
"""``0`` turns off the just-in-time checkpoint of the last completed step on failures."""

class ConfigError(DeterministicError, ValueError):
    """A setting is invalid; the message names it. A restart cannot fix it."""


DEFAULT_SIGTERM_GRACE_S = 30.0
# torchrun's agent SIGKILLs workers 30 s after its SIGTERM: a larger grace buys nothing there.
DEFAULT_PG_TIMEOUT_S = 30 * 60.0
# 30 minutes, torch's own default and what the DDP guides advise for skewed ranks: a slow rank
# (data loading, a checkpoint write, a straggling node) must not kill the job. A *dead* rank is
# still noticed at once: its process exits, the torchrun agent sees it and restarts the group.
DEFAULT_CHECKPOINT_EVERY = 100

MixedPrecision = Literal["no", "bf16", "fp16"]
_MIXED_PRECISION = ("no", "bf16", "fp16")


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}: must be a positive number of seconds, got {raw!r}")
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}: {raw!r} is not a boolean (use 1 or 0)")


def _default_jit_save() -> bool:
    return _env_bool(ENV_JIT_SAVE, True)


def _default_sigterm_grace() -> float:
    return _env_float(ENV_SIGTERM_GRACE_S, DEFAULT_SIGTERM_GRACE_S)


def _default_pg_timeout() -> float:
    return _env_float(ENV_PG_TIMEOUT_S, DEFAULT_PG_TIMEOUT_S)


def _positive(name: str, value: float | int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}: must be a positive number, got {value!r}")


def _positive_int(name: str, value: int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: must be a positive integer, got {value!r}")


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
        _positive("ddp.bucket_cap_mb", self.bucket_cap_mb)
        for name in ("find_unused_parameters", "gradient_as_bucket_view", "broadcast_buffers", "static_graph"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ddp.{name}: must be true or false, got {getattr(self, name)!r}")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """Everything the :class:`~elastic_trainer.train.trainer.Trainer` needs besides the model and data."""

    global_batch_size: int
    """Samples per optimizer step summed over all ranks; independent of the world size."""
    micro_batch_size: int | None = None
    """Most samples one rank puts through one forward; the rest of its share is accumulated
    (``no_sync``). ``None``: a rank's whole share in one forward."""
    seed: int = 0
    """Seeds the initial weights (identical on every rank) and the data order."""
    epochs: int = 1
    """Passes over the dataset."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in total, even mid-epoch. ``None``: run all epochs."""
    shuffle: bool = True
    """Shuffle the global order every epoch (seed + epoch), as ``DistributedSampler`` does."""
    checkpoint_dir: str | None = None
    """Directory shared by all nodes where rank 0 writes checkpoints. ``None``: no checkpoints."""
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY
    """Write a checkpoint every this many optimizer steps (and at the end, and on SIGTERM)."""
    keep_last: int = 3
    """Checkpoints kept on disk; older ones are deleted after a newer one is safely written."""
    async_checkpoint: bool = False
    """Snapshot to CPU on the training thread and write from a background thread."""
    sigterm_grace_s: float = field(default_factory=_default_sigterm_grace)
    """After SIGTERM, seconds to finish the step and write the checkpoint before exiting
    (env ``ELASTIC_TRAINER_SIGTERM_GRACE_S``)."""
    pg_timeout_s: float = field(default_factory=_default_pg_timeout)
    """Collective timeout of the process group (env ``ELASTIC_TRAINER_PG_TIMEOUT_S``)."""
    backend: Literal["nccl", "gloo"] | None = None
    """Process-group backend; ``None``: NCCL on CUDA, gloo on CPU."""
    mixed_precision: MixedPrecision = "no"
    """``bf16`` autocast, or ``fp16`` autocast with a GradScaler (CUDA only)."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm (CUDA only: torch's SyncBatchNorm needs a GPU)."""
    zero_redundancy: bool = False
    """Shard optimizer state with ``ZeroRedundancyOptimizer``; consolidated on rank 0 to save."""
    jit_save: bool = field(default_factory=_default_jit_save)
    """When the group fails (a peer died, or the agent stops a worker stuck in a collective), a
    surviving rank checkpoints the last completed step so that at most one step is redone (env
    ``ELASTIC_TRAINER_JIT_SAVE``; needs ``checkpoint_dir``; off with ``zero_redundancy``, whose
    sharded state cannot be saved by one rank). See :mod:`elastic_trainer.checkpoint.jit`."""
    ddp: DDPOptions = field(default_factory=DDPOptions)
    """Options for the DDP wrapper."""
    log_every: int = 10
    """Rank 0 logs a progress line every this many steps."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    record_samples_dir: str | None = None
    """Audit aid: every rank appends the dataset indices of every step to a file here."""

    def __post_init__(self) -> None:
        _positive_int("global_batch_size", self.global_batch_size)
        _positive_int("micro_batch_size", self.micro_batch_size, allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed: must be a non-negative integer, got {self.seed!r}")
        _positive_int("epochs", self.epochs)
        _positive_int("max_steps", self.max_steps, allow_none=True)
        _positive_int("checkpoint_every", self.checkpoint_every)
        _positive_int("keep_last", self.keep_last)
        _positive("sigterm_grace_s", self.sigterm_grace_s)
        _positive("pg_timeout_s", self.pg_timeout_s)
        _positive_int("log_every", self.log_every)
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ConfigError(f"num_workers: must be a non-negative integer, got {self.num_workers!r}")
        if self.backend not in (None, "nccl", "gloo"):
            raise ConfigError(f"backend: must be 'nccl', 'gloo' or unset, got {self.backend!r}")
        if self.mixed_precision not in _MIXED_PRECISION:
            raise ConfigError(
                f"mixed_precision: must be one of {', '.join(_MIXED_PRECISION)}, got {self.mixed_precision!r}"
            )
        for name in ("shuffle", "async_checkpoint", "sync_batchnorm", "zero_redundancy", "jit_save"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if self.checkpoint_dir is not None and not str(self.checkpoint_dir).strip():
            raise ConfigError("checkpoint_dir: must be a directory path or unset, got an empty string")
        if not isinstance(self.ddp, DDPOptions):
            raise ConfigError(f"ddp: must be a DDPOptions, got {type(self.ddp).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """Plain-data copy (stored in checkpoints; loadable with ``weights_only=True``)."""
        return asdict(self)
