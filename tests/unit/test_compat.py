"""The compat modules, on the real upstream libraries: what an upgrade of torch or prometheus-client
would break is tested here first."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from elastic_trainer.metrics import prometheus_compat
from elastic_trainer.runtime import torch_compat


def test_the_agent_hook_installs_and_uninstalls() -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    before = LocalElasticAgent._monitor_workers
    uninstall = torch_compat.on_group_failure(lambda failures, remaining: True)
    try:
        assert LocalElasticAgent._monitor_workers is not before
    finally:
        uninstall()
    assert LocalElasticAgent._monitor_workers is before


def test_own_buffers_foreach_copy_and_set_own_buffer() -> None:
    bn = nn.BatchNorm1d(3)
    names = [name for name, _ in torch_compat.own_buffers(bn)]
    assert names == ["running_mean", "running_var", "num_batches_tracked"]
    dst, src = [torch.zeros(3), torch.zeros(2)], [torch.ones(3), torch.full((2,), 2.0)]
    torch_compat.foreach_copy_(dst, src)
    assert dst[0].tolist() == [1.0] * 3 and dst[1].tolist() == [2.0] * 2
    replacement = torch.full((3,), 5.0)
    torch_compat.set_own_buffer(bn, "running_mean", replacement)
    assert bn.running_mean is replacement


def test_prometheus_value_files_round_trip(tmp_path: Path) -> None:
    path = str(tmp_path / prometheus_compat.db_file_name("counter", "archive"))
    prometheus_compat.write_values(path, [("key-a", (3.0, 0.0)), ("key-b", (1.5, 7.0))])
    assert sorted(prometheus_compat.read_values(path)) == [("key-a", 3.0, 0.0), ("key-b", 1.5, 7.0)]
    assert prometheus_compat.pid_file("gauge_max_123.db") == ("gauge_max", 123)
    assert prometheus_compat.pid_file("counter_archive.db") is None
    assert prometheus_compat.MERGE["counter"]((1.0, 0.0), (2.0, 0.0)) == (3.0, 0.0)
    assert prometheus_compat.MERGE["gauge_mostrecent"]((1.0, 5.0), (2.0, 4.0)) == (1.0, 5.0)
