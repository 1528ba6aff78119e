"""doctor's checks on inputs we choose: environments, probes, device counts, a world of one.

The collective checks run in this process on a one-rank gloo group (an in-process store), so
they exercise the real allreduce / DDP code paths; the multi-rank behaviour is covered by
tests/integration/test_doctor.py under torchrun.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_trainer.doctor.checks import (
    BackendProbe,
    Setup,
    TestModel,
    check_allreduce,
    check_backend,
    check_bandwidth,
    check_compute_comm,
    check_devices,
    check_env,
    check_grad_sync,
    check_placement,
    check_timeouts,
    interface_matches,
    parse_faults,
)
from elastic_trainer.doctor.report import FAIL, PASS, SKIP, WARN
from elastic_trainer.runtime.failures import first_line

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


def one_rank(**overrides: object) -> Setup:
    """A world of one on the CPU, small measurements."""
    values: dict = {"rank": 0, "world_size": 1, "device": CPU, "batch_size": 8}
    values |= {"iters": 2, "warmup": 1, "sizes": [1024, 65536]} | overrides
    return Setup(**values)


def torchrun_env(**overrides: str) -> dict[str, str]:
    env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job-1",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v != "<unset>"}


# --- env -------------------------------------------------------------------------------------


def test_env_complete_and_consistent_passes() -> None:
    result = check_env(torchrun_env())
    assert result.status == PASS
    assert (
        "WORLD_SIZE 4" in result.detail
        and "10.0.0.1:29500" in result.detail
        and "job-1" in result.detail
    )


def test_env_without_torchrun_fails_with_the_way_out() -> None:
    result = check_env({})
    assert (
        result.status == FAIL
        and "not started by torchrun" in result.detail
        and "torchrun" in result.detail
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"RANK": "4"}, "RANK=4 is not in 0..WORLD_SIZE-1 (WORLD_SIZE=4)"),
        ({"RANK": "-1"}, "RANK=-1 is not in"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 is not in 0..LOCAL_WORLD_SIZE-1"),
        ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 exceeds WORLD_SIZE=4"),
        ({"WORLD_SIZE": "four"}, "WORLD_SIZE='four' is not an integer"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        (
            {"MASTER_ADDR": "<unset>", "TORCHELASTIC_RUN_ID": "<unset>"},
            "unset: MASTER_ADDR, TORCHELASTIC_RUN_ID",
        ),
        ({"GROUP_RANK": "-2"}, "GROUP_RANK=-2"),
    ],
)
def test_env_inconsistencies_fail_naming_the_variable(
    overrides: dict[str, str], message: str
) -> None:
    result = check_env(torchrun_env(**overrides))
    assert result.status == FAIL
    assert message in result.detail


# --- backend ---------------------------------------------------------------------------------


def probe(**kw: object) -> BackendProbe:
    values: dict = {
        "distributed": True,
        "gloo": True,
        "nccl": False,
        "cuda": False,
        "nccl_version": None,
    }
    values.update(kw)
    return BackendProbe(**values)


def test_backend_cpu_with_gloo_passes() -> None:
    assert check_backend(probe()).status == PASS


def test_backend_cuda_reports_the_nccl_version() -> None:
    result = check_backend(probe(cuda=True, nccl=True, nccl_version="2.21.5"))
    assert result.status == PASS and "NCCL 2.21.5" in result.detail


@pytest.mark.parametrize(
    ("kw", "status", "message"),
    [
        ({"distributed": False}, FAIL, "torch.distributed is not available"),
        ({"cuda": True, "nccl": False}, FAIL, "no NCCL"),
        ({"cuda": True, "nccl": True, "nccl_version": None, "nccl_error": "boom"}, FAIL, "boom"),
        (
            {"cuda": True, "nccl": True, "nccl_version": "2.21.5", "gloo": False},
            WARN,
            "gloo missing",
        ),
        ({"gloo": False}, FAIL, "no CUDA and no gloo"),
    ],
)
def test_backend_problems(kw: dict, status: str, message: str) -> None:
    result = check_backend(probe(**kw))
    assert result.status == status and message in result.detail


# --- devices ---------------------------------------------------------------------------------


def devices(**kw: object) -> str:
    values: dict = {
        "cuda_devices": 0,
        "local_world_size": 2,
        "local_rank": 0,
        "cpu_count": 8,
        "cuda_visible": None,
    }
    values.update(kw)
    result = check_devices(**values)
    return f"{result.status} {result.detail}"


def test_devices_gpu_count_vs_local_world_size() -> None:
    assert devices(cuda_devices=2).startswith("PASS 2 GPU(s) for 2 local rank(s)")
    assert devices(cuda_devices=1, cuda_visible="3").startswith(
        "FAIL LOCAL_WORLD_SIZE=2 but 1 GPU(s) visible (CUDA_VISIBLE_DEVICES=3)"
    )
    assert devices(cuda_devices=8).startswith("WARN 8 GPUs visible but LOCAL_WORLD_SIZE=2: 6 idle")
    assert devices(cuda_devices=2, local_rank=2, local_world_size=2).startswith("FAIL")


def test_devices_on_cpu() -> None:
    assert devices().startswith("PASS no CUDA: 2 local rank(s) on 8 CPU core(s)")
    assert devices(local_world_size=16).startswith(
        "WARN no CUDA: 16 local ranks share 8 CPU core(s)"
    )
    assert devices(local_world_size=None).startswith(SKIP)


# --- timeouts and NCCL env ---------------------------------------------------------------------


def timeouts(env: dict[str, str], interfaces: list[str] | None = None):  # type: ignore[no-untyped-def]
    return check_timeouts(
        env, interfaces=["lo", "eth0", "ib0"] if interfaces is None else interfaces
    )


def test_timeouts_defaults_are_consistent() -> None:
    result = timeouts({})
    assert result.status == PASS
    assert "collective timeout 1800 s (default)" in result.detail
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=1800 >= timeout" in result.detail


def test_timeouts_user_values_that_agree_pass() -> None:
    result = timeouts(
        {
            "ELASTIC_TRAINER_PG_TIMEOUT_S": "600",
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900",
            "NCCL_SOCKET_IFNAME": "eth",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        }
    )
    assert result.status == PASS, result.detail
    assert (
        "600 s (ELASTIC_TRAINER_PG_TIMEOUT_S)" in result.detail
        and "NCCL_SOCKET_IFNAME=eth" in result.detail
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60"},
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=60 is below the collective timeout 1800",
        ),
        (
            {"ELASTIC_TRAINER_PG_TIMEOUT_S": "3600", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1800"},
            "below the collective timeout 3600",
        ),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, "hangs the rank instead of ending it"),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "yes"}, "is not one of 0..3"),
        ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, "the CPU waits for every collective"),
        ({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "soon"}, "is not a whole number"),
        ({"NCCL_ASYNC_ERROR_HANDLING": "1"}, "deprecated name of TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        (
            {"NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_BLOCKING_WAIT": "0"},
            "disagrees with TORCH_NCCL_BLOCKING_WAIT='0'",
        ),
        ({"NCCL_TIMEOUT": "1800"}, "NCCL_TIMEOUT is read by neither NCCL nor PyTorch"),
        (
            {"NCCL_SOCKET_IFNAME": "enp"},
            "NCCL_SOCKET_IFNAME='enp' matches no interface of this host (lo, eth0, ib0)",
        ),
        ({"GLOO_SOCKET_IFNAME": "eth"}, "GLOO_SOCKET_IFNAME='eth' matches no interface"),
    ],
)
def test_timeouts_inconsistencies_warn(env: dict[str, str], message: str) -> None:
    result = timeouts(env)
    assert result.status == WARN
    assert message in result.detail


def test_heartbeat_below_timeout_is_fine_when_monitoring_is_off() -> None:
    result = timeouts(
        {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    )
    assert result.status == PASS


def test_malformed_pg_timeout_fails() -> None:
    result = timeouts({"ELASTIC_TRAINER_PG_TIMEOUT_S": "-5"})
    assert result.status == FAIL and "training refuses to start" in result.detail


def test_timeouts_leave_the_given_environment_alone() -> None:
    env: dict[str, str] = {}
    timeouts(env)
    assert env == {}


@pytest.mark.parametrize(
    ("spec", "chosen"),
    [
        ("eth", ["eth0", "eth1"]),
        ("=eth0", ["eth0"]),
        ("^lo,docker", ["eth0", "eth1", "ib0"]),
        ("^=eth0", ["lo", "docker0", "eth1", "ib0"]),
        ("ib,eth1", ["eth1", "ib0"]),
        ("wlan", []),
    ],
)
def test_interface_matches_follows_nccl_syntax(spec: str, chosen: list[str]) -> None:
    assert interface_matches(spec, ["lo", "docker0", "eth0", "eth1", "ib0"]) == chosen


# --- faults, errors ------------------------------------------------------------------------


def test_parse_faults() -> None:
    assert parse_faults("") == frozenset()
    assert parse_faults(" allreduce , hang ") == {"allreduce", "hang"}
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        parse_faults("allreduce,nope")


def test_first_line_drops_the_cpp_location() -> None:
    exc = RuntimeError(
        "[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms\nmore"
    )
    assert first_line(exc) == "RuntimeError: Timed out waiting 5000ms"
    assert first_line(ValueError()) == "ValueError"


# --- placement -------------------------------------------------------------------------------


def test_the_doctor_model_is_its_own_cnn() -> None:
    model = TestModel()
    assert "doctor's CNN" in model.source
    inputs, target = model.batch(4, seed=0, device=CPU)
    assert model.build()(inputs).shape == (4, model.classes) and target.shape == (4,)


def test_placement_on_the_right_device_passes() -> None:
    model = TestModel()
    inputs, target = model.batch(4, seed=0, device=CPU)
    result = check_placement(model.build(), inputs, target, CPU)
    assert result.status == PASS and "all on cpu" in result.detail


def test_placement_names_misplaced_batch_and_parameters() -> None:
    model = TestModel()
    module = model.build()
    module.classifier.to("meta")  # a model moved only partly
    inputs, target = model.batch(4, seed=0, device=CPU)
    result = check_placement(module, inputs.to("meta"), target, CPU)
    assert result.status == FAIL
    assert (
        "parameter classifier.weight on meta" in result.detail and "batch on meta" in result.detail
    )


def test_placement_reports_a_failing_forward() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("Expected all tensors to be on the same device")

    inputs, target = TestModel().batch(2, seed=0, device=CPU)
    result = check_placement(Broken(), inputs, target, CPU)
    assert result.status == FAIL and "forward failed" in result.detail


# --- collective checks on a world of one ---------------------------------------------------------


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_allreduce_check(one_rank_group: None) -> None:
    assert check_allreduce(one_rank()).status == PASS
    corrupted = check_allreduce(one_rank(faults=frozenset({"allreduce"})))
    assert corrupted.status == FAIL
    assert "sum of ranks is 1 (int64) and 1 (float32), expected n(n-1)/2 = 0" in corrupted.detail


def test_grad_sync_check(one_rank_group: None) -> None:
    result = check_grad_sync(one_rank())
    assert result.status == PASS, result.detail
    assert result.data["max_rel_error_vs_mean"] <= 1e-3
    corrupted = check_grad_sync(one_rank(faults=frozenset({"grad_sync"})))
    assert corrupted.status == FAIL and "differ from the mean" in corrupted.detail


def test_bandwidth_check_measures_every_size(one_rank_group: None) -> None:
    result = check_bandwidth(one_rank())
    assert result.status == PASS
    rows = result.data["rows"]
    assert [r["size_bytes"] for r in rows] == [1024, 65536]
    assert all(r["time_us"] > 0 and r["busbw_gbps"] == 0.0 for r in rows)  # one rank: no link


def test_compute_comm_check(one_rank_group: None) -> None:
    model = TestModel(
        build=lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10)), source="linear"
    )
    result = check_compute_comm(one_rank(model=model, batch_size=4))
    assert result.status == PASS
    assert result.data["gradient_bytes"] == (3 * 16 * 16 * 10 + 10) * 4
    assert result.data["ratio"] > 0 and "compute/comm" in result.detail
