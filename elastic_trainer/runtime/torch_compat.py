"""Every use of a private torch API, in one place. Checked against torch 2.13.0.

Private names (a leading underscore) may change in any torch release. The rest of the package
calls the functions here instead, so a torch upgrade means checking this one file against the new
torch. Each entry names the torch code it relies on.

Light to import (torch, and any stdlib module the warm-start client does not load anyway, are
imported inside the functions; ``json`` it loads): the warm-start client imports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CHECKED_TORCH = "2.13.0"
"""The torch version every entry below was checked against."""


class TorchCompatError(RuntimeError):
    """This torch lacks a private API the caller needs."""


# -- torch.distributed.checkpoint (worker processes; the sharded checkpoint format) ----------------

DCP_METADATA_CLASSES = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)
"""What DCP's ``.metadata`` pickle may name (``FileSystemWriter.finish`` pickles a ``Metadata``;
torch 2.13), besides torch dtypes: the allowlist of the restricted unpickler that reads it."""


def dcp_host_state_dict(state: dict[str, Any], *, pin_memory: bool) -> dict[str, Any]:
    """Host buffers shaped like ``state`` (DTensors keep mesh and placements around a host local
    tensor): ``torch.distributed._state_dict_utils._create_cpu_state_dict`` (private)."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict

    return _create_cpu_state_dict(state, pin_memory=pin_memory)


def dcp_copy_state_dict(
    source: dict[str, Any], target: dict[str, Any], *, non_blocking: bool
) -> dict[str, Any]:
    """Copy every tensor of ``source`` into ``target``'s (same structure):
    ``torch.distributed._state_dict_utils._copy_state_dict`` (private). Returns the copy."""
    from torch.distributed._state_dict_utils import _copy_state_dict

    return _copy_state_dict(source, target, non_blocking=non_blocking)


def dcp_empty_state_dict_planner() -> type:
    """``torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner`` (private): the
    load planner that rebuilds a whole state dict from a checkpoint's metadata (DCP's own
    ``dcp_to_torch_save`` uses it)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    return _EmptyStateDictLoadPlanner


def dcp_load_whole(state: dict[str, Any], *, storage_reader: Any, planner: Any) -> None:
    """Fill the empty ``state`` with a whole checkpoint in this process, as DCP's own
    ``format_utils.dcp_to_torch_save`` does: ``state_dict_loader._load_state_dict`` (private; the
    public ``load`` fills a copy of the dict it is given, which stays empty here)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state, storage_reader=storage_reader, planner=planner, no_dist=True)


def dcp_save_in_this_process(state: dict[str, Any], *, storage_writer: Any, planner: Any) -> None:
    """``dcp.save(..., no_dist=True)`` without its warning that it assumes a single process:
    ``state_dict_saver._save_state_dict`` (private), what the public ``save`` calls after the
    warning. No warnings filter is needed, which is not thread-safe (``warnings.catch_warnings``
    swaps the process-wide list, and the just-in-time save runs beside the training thread)."""
    from torch.distributed.checkpoint.state_dict_saver import (
        _save_state_dict,
        _stateful_to_state_dict,
    )

    _save_state_dict(
        state_dict=_stateful_to_state_dict(state),
        storage_writer=storage_writer,
        no_dist=True,
        planner=planner,
    )


def dcp_fqn(model: Any, name: str) -> str:
    """``torch.distributed.checkpoint.state_dict._get_fqns`` (private): the name
    ``get_state_dict`` gives the entry ``name`` of ``model.state_dict()`` / ``named_parameters()``
    (wrapper prefixes such as ``_orig_mod`` removed). One name for an FSDP2 model."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    fqns = _get_fqns(model, name)
    if len(fqns) != 1:
        raise ValueError(f"{name}: stands for {len(fqns)} entries (an FSDP1 flat parameter)")
    return str(next(iter(fqns)))


def clear_dtensor_sharding_caches() -> None:
    """Empty DTensor's sharding-propagation caches (torch 2.13: the C++ fast path's and this
    thread's Python LRU, ``torch.distributed.tensor.debug._clear_sharding_prop_cache``, private).

    They key on ``DTensorSpec``s, and ``DeviceMesh.__eq__`` compares the ranks' layout, not this
    process's place in it: after a heal that renumbered the ranks at the same world size, a mesh
    made anew equals the old one, and a cached output spec hands the new model's DTensors the
    OLD mesh object, with this process's old coordinate. Training still works (FSDP2 reduces on
    its own mesh info), but every offset DCP records follows the old coordinate: a permuted or
    duplicated chunk layout (``docs/design/sharded.md``). Clear them before sharding a model on
    a new group (``Attempt.groups``)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def dcp_set_element(root: Any, path: Any, value: Any) -> None:
    """``torch.distributed.checkpoint._traverse.set_element`` (private): put ``value`` at
    ``path`` inside a nested state dict, as ``DefaultLoadPlanner.load_bytes`` does."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


# -- the elastic agent (launcher process) -------------------------------------------------------


def _replace(owner: type, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Set ``owner.name`` to ``replacement``; returns the function that puts the original back."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    return lambda: setattr(owner, name, original)


GroupFailureCallback = Callable[[dict[int, Any], int], bool]
"""``(failures by global rank, restarts left) -> may the agent restart?``"""


def on_group_failure(callback: GroupFailureCallback) -> Callable[[], None]:
    """Call ``callback`` whenever the agent finds its worker group failed, before it restarts it.

    Relies on ``LocalElasticAgent._monitor_workers`` (returns the failures) and
    ``SimpleElasticAgent._remaining_restarts`` (``_invoke_run`` restarts while it is > 0): a
    ``False`` from ``callback`` sets it to 0, so the agent stops its workers and returns the failure
    as after its last restart. On a torch without these names nothing is installed (one warning)
    and restarts follow ``--max-restarts``, as with plain torchrun.

    Returns:
        A function that removes the hook.
    """
    import logging

    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = getattr(LocalElasticAgent, "_monitor_workers", None)
    if original is None or not hasattr(LocalElasticAgent, "_restart_workers"):
        logging.getLogger(__name__).warning(
            "this torch's elastic agent has no _monitor_workers: every failure is retried up to "
            "--max-restarts times"
        )
        return lambda: None

    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            remaining = int(getattr(self, "_remaining_restarts", 0))
            if not callback(dict(result.failures), remaining):
                self._remaining_restarts = 0
        return result

    return _replace(LocalElasticAgent, "_monitor_workers", _monitor_workers)


def around_worker_stops(scope: Callable[[], AbstractContextManager[object]]) -> Callable[[], None]:
    """Run each stop of the agent's workers (``PContext.close``: a group restart, a signal to the
    agent, the end) inside ``scope()``. Returns a function that removes the hook."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    original = PContext.close

    def close(self: Any, *args: Any, **kwargs: Any) -> None:
        with scope():
            original(self, *args, **kwargs)

    return _replace(PContext, "close", close)


ReplacementDecision = Callable[[int, int, int], "Mapping[str, str] | None"]
"""``(local rank, pid, exit code) -> environment changes to start a replacement with``, or
``None`` to leave the failure to the agent."""


def replace_failed_workers(decide: ReplacementDecision) -> Callable[[], None]:
    """Before the agent looks at its workers, start a replacement for each one that ``decide``
    says to replace: the agent then sees a running worker (with the new pid) instead of a failed
    group, which it would stop and restart as a whole.

    Relies on ``LocalElasticAgent._monitor_workers`` and ``_pcontext`` (a ``SubprocessContext``
    with ``subprocess_handlers``, ``_running_local_ranks``, ``args``, ``envs``, ``stdouts``,
    ``stderrs``, ``entrypoint``, ``_numa_options``), ``get_subprocess_handler``, and
    ``Worker.id`` (the pid the agent compares with its context's). On a torch without them
    nothing is installed (one warning): a failed worker restarts the group, as with torchrun.

    Returns:
        A function that removes the hook.
    """
    import logging

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

    original = getattr(LocalElasticAgent, "_monitor_workers", None)
    needed = ("subprocess_handlers", "_running_local_ranks", "_numa_options")
    if original is None:
        logging.getLogger(__name__).warning(
            "this torch's elastic agent has no _monitor_workers: a killed worker "
            "restarts its whole group"
        )
        return lambda: None

    def replace(context: Any, worker_group: Any) -> None:
        for local_rank in sorted(context._running_local_ranks):
            handler = context.subprocess_handlers[local_rank]
            code = handler.proc.poll()
            if code is None or code == 0:
                continue
            changes = decide(local_rank, handler.proc.pid, code)
            if changes is None:
                continue
            env = {**context.envs[local_rank], **changes}
            context.envs[local_rank] = env
            context.subprocess_handlers[local_rank] = get_subprocess_handler(
                entrypoint=context.entrypoint,
                args=context.args[local_rank],
                env=env,
                stdout=context.stdouts[local_rank],
                stderr=context.stderrs[local_rank],
                local_rank_id=local_rank,
                numa_options=context._numa_options,
            )
            worker_group.workers[local_rank].id = context.subprocess_handlers[local_rank].proc.pid

    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        context = getattr(self, "_pcontext", None)
        if isinstance(context, SubprocessContext) and all(
            hasattr(context, name) for name in needed
        ):
            replace(context, worker_group)
        return original(self, worker_group)

    return _replace(LocalElasticAgent, "_monitor_workers", _monitor_workers)


def without_exit_barrier() -> Callable[[], None]:
    """Make torchrun's agent skip its exit barrier (``SimpleElasticAgent._exit_barrier``).

    The barrier waits for every node of the agent's last rendezvous. Healing in place, that
    rendezvous is the job's first one: a node lost since would keep every survivor's launcher
    waiting ``exit_barrier_timeout`` (300 s) after the job finished. Nothing needs it there (no
    worker uses the agent's store after its group formed). Returns a function that restores it;
    on a torch without the name nothing is installed.
    """
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    original = getattr(SimpleElasticAgent, "_exit_barrier", None)
    if original is None:
        return lambda: None

    def _exit_barrier(self: Any) -> None:
        return None

    return _replace(SimpleElasticAgent, "_exit_barrier", _exit_barrier)


AGENT_RESTART_METRIC_SUFFIX = "._restart_workers.duration.ms"
"""The ``@prof`` metric torch emits once per worker-group restart: its name ends with the private
method's (``SimpleElasticAgent._restart_workers``)."""


def start_event_nodes(event_metadata: Mapping[str, Any]) -> int:
    """Nodes in the new worker group, from a ``torchelastic.worker.status.START`` event.

    ``SimpleElasticAgent._construct_event`` nests the worker's details as a JSON string under
    ``metadata``; ``group_world_size`` is the number of agents.

    Raises:
        ValueError, KeyError, TypeError: the event is not in that format.
    """
    details = json.loads(event_metadata["metadata"])
    return int(details["group_world_size"])


# -- collectives and DDP (worker processes) -----------------------------------------------------


def forget_unfinished_default_group() -> None:
    """After ``init_process_group`` failed half way (a peer never came), let the next call name its
    group as every other process does.

    torch names the default group by a counter (``"0"`` in a fresh process; the name prefixes the
    group's store keys) that it takes before connecting and resets only in
    ``destroy_process_group``; a group that never formed is not destroyed, so the next attempt in
    the same process would wait for its peers under ``"1"`` while a fresh process writes under
    ``"0"`` (measured on torch 2.13: both waited out the collective timeout)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


def dump_flight_recorder() -> bytes:
    """The flight recorder's pickled dump: collectives, no stack traces, finished ones included
    (``torch._C._distributed_c10d._dump_fr_trace``).

    Raises:
        TorchCompatError: this torch has no such function.
    """
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]
    except ImportError as exc:
        raise TorchCompatError(f"this torch cannot dump its flight recorder ({exc})") from exc
    return _dump_fr_trace(True, False, False)  # type: ignore[no-any-return]


def ddp_logging_data(ddp_model: Any) -> Mapping[str, Any]:
    """DDP's logging data (``DistributedDataParallel._get_ddp_logging_data``): among others
    ``bucket_sizes`` and, once DDP rebuilt its buckets, ``rebuilt_bucket_sizes`` (comma-separated
    byte counts)."""
    return ddp_model._get_ddp_logging_data()  # type: ignore[no-any-return]


def set_ddp_sample_rate(ddp_model: Any, every: int) -> None:
    """Have DDP's reducer time one synchronised backward in ``every`` (besides its first ten):
    ``DistributedDataParallel._set_ddp_runtime_logging_sample_rate`` (a prototype interface in
    torch 2.13; torch's default is 100). A wrapper without it keeps its rate."""
    setter = getattr(ddp_model, "_set_ddp_runtime_logging_sample_rate", None)
    if setter is not None:
        setter(every)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every ``i`` in one kernel launch (``torch._foreach_copy_``)."""
    import torch

    torch._foreach_copy_(dst, src)


def own_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers registered on ``module`` itself (not its children), by attribute name, from
    ``Module._buffers``: unlike ``named_buffers`` it neither merges a tensor registered twice nor
    recurses."""
    for name, buffer in module._buffers.items():
        if buffer is not None:
            yield name, buffer


def set_own_buffer(module: torch.nn.Module, name: str, buffer: torch.Tensor) -> None:
    """Put ``buffer`` back as ``module``'s registered buffer ``name`` (``Module._buffers``),
    without the registration hooks ``setattr`` would run."""
    module._buffers[name] = buffer


DYNAMO_MODULE = "torch._dynamo"
"""torch.compile's module: heavy to import, so the warm-start server preloads it."""


def comm_hooks(ddp_model: Any) -> list[Any]:
    """The communication hook functions registered on ``ddp_model`` (DDP keeps ``(hook, state)``
    pairs in the private ``_comm_hooks`` list, torch 2.13). Read-only: the package registers none
    (issue 30); tests and ``benchmarks/launcher_job.py`` use it to prove that."""
    return [hook for hook, _ in getattr(ddp_model, "_comm_hooks", None) or []]


def detach_ddp(ddp_model: Any) -> None:
    """Remove the autograd hooks of ``ddp_model``'s reducer (``_remove_autograd_hooks``, private in
    torch 2.13), so that a DDP of a broken group no longer reduces the parameters' gradients even
    while something still holds it. A wrapper without that method is left as it is."""
    remove = getattr(ddp_model, "_remove_autograd_hooks", None)
    if remove is not None:
        remove()


def map_grad_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` (a tensor, or tensors in the containers ``torch.utils._pytree`` knows: tuples,
    lists, dicts, named tuples, registered output classes) with ``fn`` applied to every floating
    tensor that requires grad (``tree_map_only``, private in torch 2.13)."""
    import torch
    from torch.utils import _pytree

    def apply(t: torch.Tensor) -> torch.Tensor:
        return fn(t) if t.requires_grad and t.is_floating_point() else t

    if isinstance(tree, torch.Tensor):  # the common case, without pytree's walk
        return apply(tree)
    return _pytree.tree_map_only(torch.Tensor, apply, tree)


# -- FSDP2 (worker processes; the step's control on a reduce-scatter) ---------------------------


def is_fsdp_unit(module: torch.nn.Module) -> bool:
    """``module`` went through ``fully_shard`` (public ``FSDPModule``) and has a parameter group
    of its own (``FSDPState._fsdp_param_groups``, private in torch 2.13: a unit without
    parameters of its own has none and reduce-scatters nothing)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return False
    return bool(module._get_fsdp_state()._fsdp_param_groups)


def fsdp_reduce_scatter_comm(module: Any) -> Any:
    """The reduce-scatter comm of the FSDP unit ``module`` (``FSDPParamGroup._reduce_scatter_comm``,
    private in torch 2.13; ``set_custom_reduce_scatter`` sets it, nothing public reads it), so
    that a replacement can be undone. The unit must have exactly one parameter group (as
    ``set_custom_reduce_scatter`` requires)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) != 1:
        raise TorchCompatError(f"an FSDP unit with {len(groups)} parameter groups")
    return groups[0]._reduce_scatter_comm


def fsdp_default_reduce_scatter(module: Any) -> bool:
    """The FSDP unit ``module`` has one parameter group, on FSDP's own reduce-scatter
    (``DefaultReduceScatter`` of ``torch.distributed.fsdp._fully_shard._fsdp_collectives``,
    torch 2.13): no custom comm of the user's, no symmetric memory."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    groups = module._get_fsdp_state()._fsdp_param_groups
    return len(groups) == 1 and type(groups[0]._reduce_scatter_comm) is DefaultReduceScatter
