"""Unit tests of the distributed setup: environment parsing, NCCL settings, teardown."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic_trainer.runtime import distributed as d

pytestmark = pytest.mark.timeout(60)

TORCHRUN_ENV = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "TORCHELASTIC_RESTART_COUNT": "2",
}


def test_torchrun_environment_on_cpu() -> None:
    env = d.read_env(environ=dict(TORCHRUN_ENV), cuda_devices=0)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert env.restart_count == 2 and env.launched
    assert env.device == torch.device("cpu") and env.backend == "gloo"


def test_cuda_present_means_own_gpu_and_nccl() -> None:
    env = d.read_env(environ=dict(TORCHRUN_ENV), cuda_devices=2)
    assert env.device == torch.device("cuda", 1) and env.backend == "nccl"
    assert d.read_env(environ=dict(TORCHRUN_ENV), cuda_devices=2, backend="gloo").backend == "gloo"


def test_local_rank_without_its_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 but only 1 CUDA device\(s\) are visible"):
        d.read_env(environ=dict(TORCHRUN_ENV), cuda_devices=1)


def test_nccl_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'nccl' needs CUDA"):
        d.read_env(environ=dict(TORCHRUN_ENV), cuda_devices=0, backend="nccl")


@pytest.mark.parametrize(
    "argv", [["--local_rank=1", "--x"], ["--local-rank", "1", "--x"], ["--x", "--local_rank", "1"]]
)
def test_legacy_local_rank_argument(argv: list[str]) -> None:
    local_rank, rest = d.strip_local_rank_arg(argv)
    assert local_rank == 1 and rest == ["--x"]
    environ = {"RANK": "1", "WORLD_SIZE": "2"}
    env = d.read_env(local_rank_arg=local_rank, environ=environ, cuda_devices=0)
    assert env.local_rank == 1


def test_local_rank_env_wins_over_the_argument() -> None:
    env = d.read_env(local_rank_arg=0, environ=dict(TORCHRUN_ENV), cuda_devices=0)
    assert env.local_rank == 1


def test_no_launcher_means_one_process() -> None:
    env = d.read_env(environ={}, cuda_devices=0)
    assert (env.rank, env.world_size, env.launched) == (0, 1, False)


@pytest.mark.parametrize(
    "environ,match",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK: 'x' is not an integer"),
        ({"RANK": "0"}, "RANK and WORLD_SIZE must both be set"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not within WORLD_SIZE=2"),
    ],
)
def test_malformed_environment(environ: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        d.read_env(environ=environ, cuda_devices=0)


def test_nccl_environment_is_consistent_with_the_timeout_and_keeps_user_values() -> None:
    environ: dict[str, str] = {}
    applied = d.configure_nccl_environment(1800, environ)
    assert (
        environ
        == {
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "TORCH_NCCL_ENABLE_MONITORING": "1",
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1800",
        }
        == applied
    )
    user = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600"}
    d.configure_nccl_environment(1800, user)
    assert user["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "600"


def test_async_error_handling_off_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    d.configure_nccl_environment(60, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert "hanging" in caplog.text


def test_a_process_by_hand_forms_a_group_of_one_and_destroying_it_is_idempotent() -> None:
    env = d.read_env(environ={}, cuda_devices=0)
    try:
        d.init_process_group(env, pg_timeout_s=60)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        d.destroy_process_group()
    assert not dist.is_initialized()
    d.destroy_process_group()  # idempotent


def _agent_env(port: int, **overrides: str) -> dict[str, str]:
    environ = {
        **TORCHRUN_ENV,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "GROUP_WORLD_SIZE": "1",
    }
    environ.update(overrides)
    return environ


def test_one_agents_shared_store_is_keyed_by_the_attempt() -> None:
    """torchrun --standalone serves one store to every restart: a restarted group's keys must not
    meet the addresses the last attempt left there (each attempt's group reads its own keys)."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
    server.set("default_pg/0/rank_0", "stale address of the last attempt")
    for attempt in ("1", "2"):
        environ = _agent_env(server.port, TORCHELASTIC_RESTART_COUNT=attempt)
        env = d.read_env(environ=environ, cuda_devices=0)
        store = d.attempt_store(env, timedelta(seconds=10), environ)
        assert store is not None
        assert not store.check(["0/rank_0"]), "no key of another attempt is seen"
        store.set("0/rank_0", f"attempt {attempt}")
    assert server.get("elastic-trainer/attempt-1/group-0/default_pg/0/rank_0") == b"attempt 1"
    assert server.get("elastic-trainer/attempt-2/group-0/default_pg/0/rank_0") == b"attempt 2"


def test_a_second_group_of_one_attempt_reads_none_of_the_firsts_keys() -> None:
    """Two groups formed by one process in one attempt (two ``fit`` calls): every process forms
    them in the same order, so the order names the group."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
    environ = _agent_env(server.port, TORCHELASTIC_RESTART_COUNT="7")
    env = d.read_env(environ=environ, cuda_devices=0)
    first = d.attempt_store(env, timedelta(seconds=10), environ)
    assert first is not None
    first.set("0/rank_0", "the first group's address")
    second = d.attempt_store(env, timedelta(seconds=10), environ)
    assert second is not None
    assert not second.check(["0/rank_0"]), "the second group sees the first one's key"


@pytest.mark.parametrize(
    "overrides",
    [
        {"GROUP_WORLD_SIZE": "2"},  # two agents: their restart counts differ
        {"TORCHELASTIC_USE_AGENT_STORE": "False"},  # a fresh store per round
    ],
)
def test_torchs_own_store_everywhere_else(overrides: dict[str, str]) -> None:
    environ = _agent_env(1, **overrides, ELASTIC_TRAINER_RDZV_BACKEND="etcd-v3")
    env = d.read_env(environ=environ, cuda_devices=0)
    assert d.attempt_store(env, timedelta(seconds=1), environ) is None


@pytest.mark.parametrize(("backend", "warned"), [(None, True), ("etcd-v3", False)])
def test_c10d_across_nodes_is_warned_about_once_by_rank_0(
    backend: str | None, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Several agents sharing torch's c10d store: nothing can key the attempt, so rank 0 says what
    to launch with instead; under etcd-v3 (its agents mark their workers' environment) the store
    is new every round and nothing is said."""
    for rank in ("0", "1"):
        environ = _agent_env(1, GROUP_WORLD_SIZE="2", RANK=rank)
        if backend is not None:
            environ["ELASTIC_TRAINER_RDZV_BACKEND"] = backend
        env = d.read_env(environ=environ, cuda_devices=0)
        assert d.attempt_store(env, timedelta(seconds=1800), environ) is None
    lines = [r.getMessage() for r in caplog.records if "share one store" in r.getMessage()]
    assert len(lines) == (1 if warned else 0), lines
    if warned:
        assert "(1800 s)" in lines[0] and "--rdzv-backend=etcd-v3" in lines[0]


def test_a_job_that_cannot_restart_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    environ = _agent_env(1, GROUP_WORLD_SIZE="2", RANK="0", TORCHELASTIC_MAX_RESTARTS="0")
    env = d.read_env(environ=environ, cuda_devices=0)
    assert d.attempt_store(env, timedelta(seconds=1800), environ) is None
    assert not [r for r in caplog.records if "share one store" in r.getMessage()]
