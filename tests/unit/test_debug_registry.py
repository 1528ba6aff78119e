"""``elastic-trainer debug``'s reading of the registry (which entry is a live rank, after heals,
replacements and leaves) and its one-line mistakes. The real job: ``tests/chaos/test_diagnostics.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from elastic_trainer.launch.node_metrics import JobInfo, serve_node_metrics
from elastic_trainer.launch.options import UserError
from elastic_trainer.ops.debug import _reached_from, job_of_url
from elastic_trainer.train.diagnostics import launchers_of, live_ranks

pytestmark = pytest.mark.timeout(60)


def kv(revision: int, **entry: object) -> SimpleNamespace:
    return SimpleNamespace(value=json.dumps(entry).encode(), mod_revision=revision)


def entry(rank: int, world: int, node: str, local: int, pid: int) -> dict[str, object]:
    return {"rank": rank, "world_size": world, "node": node, "local_rank": local, "pid": pid,
            "url": f"http://127.0.0.1:{40000 + pid}"}  # fmt: skip


def test_the_newest_world_and_each_ranks_newest_entry() -> None:
    kvs = [
        kv(10, **entry(0, 4, "a", 0, 100)), kv(11, **entry(1, 4, "a", 1, 101)),
        kv(12, **entry(2, 4, "b", 0, 200)), kv(13, **entry(3, 4, "b", 1, 201)),
        # node b left; the heal renumbered a's ranks into a world of 2, a's local 1 replaced:
        kv(20, **entry(0, 2, "a", 0, 100)), kv(21, **entry(1, 2, "a", 1, 102)),
    ]  # fmt: skip
    ranks, missing = live_ranks(kvs)
    assert [(r.rank, r.pid) for r in ranks] == [(0, 100), (1, 102)]
    assert missing == []
    assert ranks[1].title() == "rank 1 (node a, local 1, pid 102)"


def test_a_rank_without_an_entry_in_the_newest_world_is_named() -> None:
    kvs = [kv(5, **entry(0, 3, "a", 0, 1)), kv(6, **entry(2, 3, "b", 1, 3))]
    ranks, missing = live_ranks(kvs)
    assert [r.rank for r in ranks] == [0, 2] and missing == [1]


def test_entries_that_are_not_ranks_are_skipped() -> None:
    kvs = [
        SimpleNamespace(value=b"not json", mod_revision=1),
        kv(2, role="launcher", node="a", pid=9, url="http://127.0.0.1:1"),
        kv(3, **entry(0, 1, "a", 0, 7)),
    ]
    ranks, _ = live_ranks(kvs)
    assert [r.pid for r in ranks] == [7]
    launchers = launchers_of(kvs, {"a"})
    assert [(x.node, x.pid, x.stem) for x in launchers] == [("a", 9, "launcher-a")]
    assert launchers_of(kvs, {"b"}) == []  # a launcher of a node no live rank is on
    assert live_ranks([]) == ([], [])


@pytest.mark.parametrize(
    ("words", "line"),
    [
        (["stacks", "--timeout", "0"], "--timeout: 0 is not a number of seconds in (0, 3600]"),
        (["profile", "--steps", "0"], "--steps: 0 is not in 1..1000"),
        (["dump"], "dump: --out DIR is needed (one file per rank and kind)"),
        (["stacks", "--rdzv-conf", "nonsense"], "rdzv-conf: 'nonsense' is not KEY=VALUE"),
    ],
)
def test_mistakes_are_one_line(words: list[str], line: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", "debug", *words,
         "--rdzv-endpoint", "127.0.0.1:1", "--run-id", "x"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"elastic-trainer: error: {line}"]


def test_an_unreachable_etcd_is_one_line_within_its_bound() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", "debug", "stacks",
         "--rdzv-endpoint", "127.0.0.1:1", "--run-id", "x", "--rdzv-conf", "retry_timeout=1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("elastic-trainer: error: cannot read the run 'x': "), line


@pytest.mark.parametrize(
    ("words", "line"),
    [
        (["--url", "127.0.0.1:1", "--run-id", "x"],
         "give --url, or --rdzv-endpoint with --run-id, not both"),
        (["--run-id", "x"],
         "the job: give --rdzv-endpoint and --run-id, or a node's metrics --url"),
        (["--url", "ftp://h:1"], "--url 'ftp://h:1': expected host:port or http(s)://host:port/metrics"),
    ],
)  # fmt: skip
def test_the_job_is_named_one_way(words: list[str], line: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", "debug", "stacks", *words],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"elastic-trainer: error: {line}"]


def test_a_nodes_metrics_url_names_its_job(tmp_path) -> None:
    """A launcher's metrics endpoint serves ``elastic_trainer_job_info``: ``debug --url`` reads the
    job's etcd and run id there; another endpoint is one line that says what is missing."""
    with_job = serve_node_metrics(
        "127.0.0.1", 0, str(tmp_path),
        extra=[JobInfo(run_id="job-7", node="a", rdzv_endpoint="etcd-0:2379,etcd-1:2379")],
    )  # fmt: skip
    without = serve_node_metrics("127.0.0.1", 0, str(tmp_path))
    try:
        assert job_of_url(f"127.0.0.1:{with_job.port}", 5.0) == ("etcd-0:2379,etcd-1:2379", "job-7")
        with pytest.raises(UserError, match="no elastic_trainer_job_info there"):
            job_of_url(without.url, 5.0)
    finally:
        with_job.close()
        without.close()
    with pytest.raises(UserError, match=r"^--url 127\.0\.0\.1:1: "):
        job_of_url("127.0.0.1:1", 2.0)


@pytest.mark.parametrize(
    ("endpoint", "host", "reached"),
    [
        ("127.0.0.1:2379", "node-0", "node-0:2379"),  # the embedded etcd, asked from elsewhere
        ("127.0.0.1:2379", "127.0.0.1", "127.0.0.1:2379"),  # asked on the node itself
        ("http://0.0.0.0:2379", "10.0.0.5", "http://10.0.0.5:2379"),
        ("[::1]:2379", "node-0", "node-0:2379"),
        ("etcd-0:2379,etcd-1:2379", "node-0", "etcd-0:2379,etcd-1:2379"),  # a real cluster
    ],
)
def test_a_nodes_own_etcd_is_reached_at_the_nodes_address(
    endpoint: str, host: str, reached: str
) -> None:
    assert _reached_from(endpoint, host) == reached
