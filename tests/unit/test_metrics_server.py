"""The node endpoint: multiprocess merge, dead-worker cleanup, launcher setup and teardown."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from torch.distributed.elastic import metrics as torch_metrics

from elastic_trainer.launch.node_metrics import (
    FamilyReader,
    LauncherMetricsConfig,
    LiveMultiProcessCollector,
    MetricsError,
    pid_alive,
    serve_node_metrics,
    start_launcher_metrics,
)
from elastic_trainer.metrics.progress import FAMILIES, Snapshot, samples_of

pytestmark = pytest.mark.timeout(60)

# A worker process in miniature: the real observer in multiprocess mode, then exit.
WORKER = """
import sys
from elastic_trainer.metrics.worker import worker_observer
obs = worker_observer()
obs.on_start(world_size=2, restart_count=int(sys.argv[1]), total_steps=100)
obs.on_step(step=1, duration_s=0.1, data_wait_s=0.0, samples=8, tokens=0, loss=0.5, lr=0.1)
"""
NODE_NAME = "host-w-4242"  # what the launcher exports as ELASTIC_TRAINER_NODE


def run_worker(
    directory: Path, *, rank: int, restart_count: int = 0, node: str | None = NODE_NAME
) -> int:
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(directory), RANK=str(rank),
               LOCAL_RANK=str(rank), TORCHELASTIC_RUN_ID="job")  # fmt: skip
    if node == "":  # a worker without a launcher
        env.pop("ELASTIC_TRAINER_NODE", None)
    elif node is not None:  # None: whatever this process exports
        env["ELASTIC_TRAINER_NODE"] = node
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(restart_count)], env=env, timeout=60, check=True
    )
    assert proc.returncode == 0
    return len(list(directory.glob("counter_*.db")))


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def find(samples: dict, name: str, **labels: str) -> list[float]:
    return [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]


def test_dead_workers_counters_stay_and_live_gauges_go(tmp_path: Path) -> None:
    run_worker(tmp_path, rank=0)
    run_worker(tmp_path, rank=0, restart_count=1)  # the "restarted" worker: same labels
    registry = CollectorRegistry()
    collector = LiveMultiProcessCollector(str(tmp_path))
    registry.register(collector)
    labels = {"run_id": "job", "node": NODE_NAME, "rank": "0", "local_rank": "0"}
    # Both processes exited: their samples add up, their live gauges (loss, lr) are gone, the
    # facts that stay true (target, time of the last step) stay.
    assert registry.get_sample_value("elastic_trainer_samples_total", labels) == 16
    assert registry.get_sample_value("elastic_trainer_loss", labels) is None
    node = {"run_id": "job", "node": NODE_NAME}
    assert registry.get_sample_value("elastic_trainer_learning_rate", node) is None
    assert registry.get_sample_value("elastic_trainer_target_steps", node) == 100
    last_step = registry.get_sample_value("elastic_trainer_last_step_timestamp_seconds", node)
    assert last_step is not None and abs(last_step - time.time()) < 600
    assert not list(tmp_path.glob("gauge_live*"))
    assert list(tmp_path.glob("counter_*.db"))


def snapshot(collector: LiveMultiProcessCollector) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }


def test_dead_workers_files_fold_into_archives_without_changing_any_value(tmp_path: Path) -> None:
    run_worker(tmp_path, rank=0)
    run_worker(tmp_path, rank=1, restart_count=1)
    keep_all = snapshot(LiveMultiProcessCollector(str(tmp_path), is_alive=lambda p: True))
    collector = LiveMultiProcessCollector(str(tmp_path))
    retired = snapshot(collector)
    # Only the live gauges (pid-labelled liveness, step, loss, ...) of the dead went away.
    live_names = {"elastic_trainer_loss", "elastic_trainer_step", "elastic_trainer_world_size",
                  "elastic_trainer_learning_rate",
                  "elastic_trainer_allreduce_bus_bandwidth_bytes_per_second"}  # fmt: skip
    assert {k: v for k, v in keep_all.items() if k[0] not in live_names} == retired
    names = sorted(p.name for p in tmp_path.glob("*.db"))
    assert names == ["counter_archive.db", "gauge_max_archive.db", "gauge_mostrecent_archive.db",
                     "histogram_archive.db"]  # fmt: skip
    # Later workers add to the archived totals: the counter keeps rising.
    run_worker(tmp_path, rank=0)
    labels = {"run_id": "job", "node": NODE_NAME, "rank": "0", "local_rank": "0"}
    registry = CollectorRegistry()
    registry.register(collector)
    assert registry.get_sample_value("elastic_trainer_samples_total", labels) == 16
    node = {"run_id": "job", "node": NODE_NAME}
    assert registry.get_sample_value("elastic_trainer_target_steps", node) == 100
    assert sorted(p.name for p in tmp_path.glob("*.db")) == names


def test_the_family_reader_reads_what_the_endpoint_serves_of_its_families(tmp_path: Path) -> None:
    run_worker(tmp_path, rank=0)
    run_worker(tmp_path, rank=1, restart_count=1)
    collector = LiveMultiProcessCollector(str(tmp_path), is_alive=lambda p: True)
    wanted = {"elastic_trainer_step", "elastic_trainer_samples", "elastic_trainer_loss",
              "elastic_trainer_step_duration_seconds", "elastic_trainer_target_steps"}  # fmt: skip
    everything = snapshot(collector)
    expected = {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in collector.collect() if family.name in wanted for s in family.samples}  # fmt: skip
    reader = FamilyReader(collector, [], wanted)
    for _ in range(2):  # the second read from the kept keys
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in reader.collect() for s in family.samples}  # fmt: skip
        assert got == expected
    assert any(name.endswith("_bucket") for name, _ in got)  # histograms accumulated as served
    assert len(got) < len(everything)  # the other families not read


def test_the_progress_families_are_every_one_a_snapshot_reads(tmp_path: Path) -> None:
    run_worker(tmp_path, rank=0)
    collector = LiveMultiProcessCollector(str(tmp_path), is_alive=lambda p: True)
    full = Snapshot.from_samples(samples_of(collector.collect()), taken_at=0.0)
    narrow = FamilyReader(collector, [], (name for name in FAMILIES))  # any iterable
    assert Snapshot.from_samples(samples_of(narrow.collect()), taken_at=0.0) == full
    assert full.lr is not None and full.step_buckets  # what a missing family would lose


def test_live_gauges_of_running_pids_are_kept(tmp_path: Path) -> None:
    run_worker(tmp_path, rank=1)
    (live,) = tmp_path.glob("gauge_livemostrecent_*.db")
    pid = int(live.stem.rsplit("_", 1)[1])
    collector = LiveMultiProcessCollector(str(tmp_path), is_alive=lambda p: p == pid)
    assert collector.reap() == []
    assert live.exists() and (tmp_path / f"counter_{pid}.db").exists()
    collector = LiveMultiProcessCollector(str(tmp_path), is_alive=lambda p: False)
    assert collector.reap() == [pid]
    assert not live.exists() and not (tmp_path / f"counter_{pid}.db").exists()


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert not pid_alive(proc.pid)


def test_serve_node_metrics_serves_workers_and_agent(tmp_path: Path) -> None:
    from elastic_trainer.launch.agent_metrics import AgentMetrics

    run_worker(tmp_path, rank=0)
    agent = AgentMetrics(run_id="job", node="host-a")
    server = serve_node_metrics("127.0.0.1", 0, str(tmp_path), agent_metrics=agent)
    try:
        agent.restarted()
        samples = scrape(server.url)
        assert find(samples, "elastic_trainer_samples_total", rank="0") == [8.0]
        assert find(samples, "elastic_trainer_restarts_total", node="host-a") == [1.0]
    finally:
        server.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)


def test_busy_port_is_one_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            serve_node_metrics("127.0.0.1", port, str(tmp_path))
    with pytest.raises(MetricsError, match="does not exist"):
        serve_node_metrics("127.0.0.1", 0, str(tmp_path / "missing"))


def test_default_node_name_is_short_host_and_launcher_pid() -> None:
    """The name ``status`` derives from the rendezvous: the first label of the host's fqdn (the
    lease handler's address) and the agent's pid, which is this (the launcher's) process."""
    assert LauncherMetricsConfig().node == f"{socket.getfqdn().split('.')[0]}-{os.getpid()}"


def test_a_worker_without_a_launcher_uses_the_short_host_name(tmp_path: Path) -> None:
    run_worker(tmp_path, rank=0, node="")
    registry = CollectorRegistry()
    registry.register(LiveMultiProcessCollector(str(tmp_path)))
    labels = {
        "run_id": "job",
        "node": socket.gethostname().split(".")[0],
        "rank": "0",
        "local_rank": "0",
    }
    assert registry.get_sample_value("elastic_trainer_samples_total", labels) == 8


def test_config_validation() -> None:
    with pytest.raises(MetricsError, match="run_id"):
        LauncherMetricsConfig(run_id="")
    assert LauncherMetricsConfig().port == 9400
    assert LauncherMetricsConfig().addr == "0.0.0.0"
    with pytest.raises(ValueError, match="port"):
        LauncherMetricsConfig(port=70000)
    with pytest.raises(ValueError, match="addr"):
        LauncherMetricsConfig(addr="")
    with pytest.raises(ValueError, match="run_id"):
        LauncherMetricsConfig(run_id="")


def test_start_launcher_metrics_sets_up_and_undoes_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("ELASTIC_TRAINER_METRICS", raising=False)
    handler_before = torch_metrics.getStream("torchelastic").handler
    monkeypatch.delenv("ELASTIC_TRAINER_NODE", raising=False)
    config = LauncherMetricsConfig(addr="127.0.0.1", port=0, run_id="job", node="host-a-77")
    with start_launcher_metrics(config) as handle:
        directory = handle.multiproc_dir
        assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == directory
        assert os.environ["ELASTIC_TRAINER_METRICS"] == "1"
        assert os.environ["ELASTIC_TRAINER_NODE"] == "host-a-77"
        assert (handle.node, handle.run_id) == ("host-a-77", "job")
        run_worker(Path(directory), rank=0, node=None)  # inherits the launcher's environment
        torch_metrics.put_metric("SimpleElasticAgent._restart_workers.duration.ms", 10)
        samples = scrape(handle.url)
        # Workers and agent name the node alike.
        assert find(samples, "elastic_trainer_samples_total", node="host-a-77") == [8.0]
        assert find(samples, "elastic_trainer_restarts_total", node="host-a-77") == [1.0]
        # The registry in-process is what the endpoint serves.
        assert (
            handle.registry.get_sample_value(
                "elastic_trainer_samples_total",
                {"run_id": "job", "node": "host-a-77", "rank": "0", "local_rank": "0"},
            )
            == 8.0
        )
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    assert "ELASTIC_TRAINER_METRICS" not in os.environ
    assert "ELASTIC_TRAINER_NODE" not in os.environ
    assert not os.path.exists(directory)
    assert torch_metrics.getStream("torchelastic").handler is handler_before
    handle.close()  # idempotent


def test_given_directory_is_emptied_of_stale_files_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_TRAINER_METRICS", "0")  # an explicit user choice is kept
    run_worker(tmp_path, rank=0)
    config = LauncherMetricsConfig(addr="127.0.0.1", port=0, multiproc_dir=str(tmp_path))
    with start_launcher_metrics(config) as handle:
        assert not list(tmp_path.glob("*.db"))
        assert find(scrape(handle.url), "elastic_trainer_samples_total") == []
        assert os.environ["ELASTIC_TRAINER_METRICS"] == "0"
    assert tmp_path.is_dir()


def test_failed_start_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    handler_before = torch_metrics.getStream("torchelastic").handler
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = LauncherMetricsConfig(addr="127.0.0.1", port=taken.getsockname()[1])
        with pytest.raises(MetricsError):
            start_launcher_metrics(config)
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    assert torch_metrics.getStream("torchelastic").handler is handler_before


def test_worker_observer_honours_allreduce_switch(tmp_path: Path) -> None:
    code = (
        "from elastic_trainer.metrics.worker import worker_observer\n"
        "assert worker_observer().time_allreduce is False\n"
        "assert worker_observer() is worker_observer()\n"
    )
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
               ELASTIC_TRAINER_METRICS_ALLREDUCE="0")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], env=env, timeout=60, check=True)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("sampled", "True False 0 unset"),
        ("TRACE", "True True 2000 1"),
        ("no", "False False 0 unset"),
    ],
)
def test_worker_observer_allreduce_modes(tmp_path: Path, mode: str, expected: str) -> None:
    """``trace`` turns the flight recorder and NCCL's timing on in the worker's environment (before
    its process group exists); an unknown mode is a one-line error naming the variable."""
    code = (
        "import os\n"
        "from elastic_trainer.metrics.worker import worker_observer\n"
        "o = worker_observer()\n"
        "print(o.time_allreduce, o.trace_allreduce, os.environ.get('TORCH_FR_BUFFER_SIZE', '0'),\n"
        "      os.environ.get('TORCH_NCCL_ENABLE_TIMING', 'unset'))\n"
    )
    env = dict(
        os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), ELASTIC_TRAINER_METRICS_ALLREDUCE=mode
    )
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    env.pop("TORCH_NCCL_ENABLE_TIMING", None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, timeout=60, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == expected.split()


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("traec", "ELASTIC_TRAINER_METRICS_ALLREDUCE='traec': expected sampled, trace or 0"),
        (
            "hook",
            "ELASTIC_TRAINER_METRICS_ALLREDUCE=hook was removed (a Python comm hook on every "
            "gradient bucket slowed the step): use sampled (the default) or trace",
        ),
    ],
)
def test_a_worker_refuses_an_unknown_or_removed_allreduce_mode(
    tmp_path: Path, mode: str, message: str
) -> None:
    """A one-line ConfigError, no traceback; the removed ``hook`` mode says what replaces it."""
    code = (
        "from elastic_trainer.runtime.failures import ConfigError\n"
        "from elastic_trainer.metrics.worker import worker_observer\n"
        "try:\n"
        "    worker_observer()\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    env = dict(
        os.environ,
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
        ELASTIC_TRAINER_METRICS_ALLREDUCE=mode,
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, timeout=60, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == message, done


def test_launcher_rejects_an_unknown_allreduce_mode_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ELASTIC_TRAINER_METRICS_ALLREDUCE", "hooks")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with pytest.raises(
        MetricsError,
        match="ELASTIC_TRAINER_METRICS_ALLREDUCE='hooks': expected sampled, trace or 0",
    ):
        start_launcher_metrics(LauncherMetricsConfig(addr="127.0.0.1", port=0))
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ


# A worker whose rank changes: RANK=3 from its launcher, then rank 0 in the job's process group.
RELABELLED_WORKER = """
import torch.distributed as dist
from elastic_trainer.metrics.worker import worker_observer
obs = worker_observer()
obs.on_start(world_size=4, restart_count=0)
obs.on_step(step=1, duration_s=0.1, data_wait_s=0.0, samples=8, tokens=0, loss=0.5)
obs.flush()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
obs.on_start(world_size=1, restart_count=0)
obs.on_step(step=2, duration_s=0.1, data_wait_s=0.0, samples=8, tokens=0, loss=0.25)
obs.flush()
dist.destroy_process_group()
"""


def test_a_worker_whose_rank_changed_serves_only_its_new_rank_as_live(tmp_path: Path) -> None:
    """In multiprocess mode a series cannot be removed: the old rank's step reads NaN, which the
    snapshot (`top`, the progress publisher) skips; counters keep what each rank did."""
    from elastic_trainer.metrics.progress import Snapshot, samples_of

    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), RANK="3", LOCAL_RANK="1",
               TORCHELASTIC_RUN_ID="job", ELASTIC_TRAINER_NODE=NODE_NAME)  # fmt: skip
    subprocess.run([sys.executable, "-c", RELABELLED_WORKER], env=env, timeout=60, check=True)
    collector = LiveMultiProcessCollector(str(tmp_path), is_alive=lambda p: True)  # as if alive
    values = snapshot(collector)
    old = (("local_rank", "1"), ("node", NODE_NAME), ("rank", "3"), ("run_id", "job"))
    new = (("local_rank", "1"), ("node", NODE_NAME), ("rank", "0"), ("run_id", "job"))
    assert values[("elastic_trainer_step", old)] != values[("elastic_trainer_step", old)]  # NaN
    assert values[("elastic_trainer_step", new)] == 2
    assert values[("elastic_trainer_samples_total", old)] == 8
    assert values[("elastic_trainer_samples_total", new)] == 8
    snap = Snapshot.from_samples(samples_of(collector.collect()), taken_at=0.0)
    assert snap.nodes[NODE_NAME].ranks == (0,) and (snap.step, snap.loss) == (2, 0.25)
