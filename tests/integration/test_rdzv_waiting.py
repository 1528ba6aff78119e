"""Waiting for nodes is visible: progress lines while below the minimum or in the last call, and
a join timeout that says how many nodes had joined (real etcd; real torchrun for the default
log level)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousTimeoutError

from rendezvous.handler import create_handler
from rendezvous.lease_handler import LeaseRendezvousHandler

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).with_name("scripts") / "ddp_steps.py")
LOGGER = "rendezvous.lease_handler"


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and "waiting for" in r.getMessage()
    ]


@pytest.fixture
def fast_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LeaseRendezvousHandler, "_PROGRESS_LOG_S", 0.5)


def test_below_the_minimum_a_node_says_how_many_joined_then_times_out_saying_so(
    etcd_server, unique_id: str, caplog: pytest.LogCaptureFixture, fast_progress: None
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    params = RendezvousParameters(
        "etcd-v3", etcd_server.endpoint, unique_id, 2, 3, join_timeout="3", retry_timeout="10"
    )
    handler = create_handler(params)
    try:
        with pytest.raises(RendezvousTimeoutError) as raised:
            handler.next_rendezvous()
    finally:
        handler.shutdown()
    assert str(raised.value) == (
        f"etcd-v3: no rendezvous of run {unique_id!r} within 3s: "
        "1 of min 2 nodes had joined round 0"
    )
    lines = progress_lines(caplog)
    assert len(lines) >= 2, lines
    assert all(
        line.startswith(f"etcd-v3: run {unique_id}: waiting for nodes: 1 of min 2 joined, ")
        and line.endswith(" s left")
        for line in lines
    ), lines
    left = [int(line.rsplit(", ", 1)[1].split()[0]) for line in lines]
    assert left == sorted(left, reverse=True) and left[0] <= 3, lines


def test_the_last_call_is_announced_and_then_the_round_closes(
    etcd_server, unique_id: str, caplog: pytest.LogCaptureFixture, fast_progress: None
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    params = RendezvousParameters(
        "etcd-v3", etcd_server.endpoint, unique_id, 1, 2, last_call_timeout="2", retry_timeout="10"
    )
    handler = create_handler(params)
    try:
        info = handler.next_rendezvous()
    finally:
        handler.shutdown()
    assert (info.rank, info.world_size) == (0, 1)
    lines = progress_lines(caplog)
    assert lines, "no line during the last call"
    assert all(
        f"run {unique_id}: waiting for more nodes: 1 joined (min 1, max 2), last call ends in "
        in line
        for line in lines
    ), lines


def test_a_restart_round_that_closes_at_once_logs_nothing(
    etcd_server, unique_id: str, caplog: pytest.LogCaptureFixture, fast_progress: None
) -> None:
    params = RendezvousParameters(
        "etcd-v3", etcd_server.endpoint, unique_id, 1, 1, retry_timeout="10"
    )
    handler = create_handler(params)
    try:
        handler.next_rendezvous()
        caplog.set_level(logging.WARNING, logger=LOGGER)
        handler.next_rendezvous()  # max reached at once: nothing to wait for, nothing to say
    finally:
        handler.shutdown()
    assert progress_lines(caplog) == []


def test_torchrun_shows_the_waiting_lines_by_default(
    etcd_server, unique_id: str, tmp_path: Path
) -> None:
    """Plain torchrun configures no logging: the lines must pass Python's default (WARNING)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--rdzv-backend=etcd-v3",
            f"--rdzv-endpoint={etcd_server.endpoint}",
            f"--rdzv-id={unique_id}",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-conf=join_timeout=8,retry_timeout=10",
            SCRIPT,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode != 0
    assert f"etcd-v3: run {unique_id}: waiting for nodes: 1 of min 2 joined, " in done.stderr, (
        done.stderr[-3000:]
    )
    assert "1 of min 2 nodes had joined round 0" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "starts").exists()  # no worker started


def test_waiting_for_a_previous_member_to_rejoin_does_not_poll_etcd(
    etcd_server, unique_id: str, fast_progress: None
) -> None:
    """No progress line is due in a restart round, and no busy loop either: the node sleeps on
    its watch (a safety re-read every 2 s) until the live member it waits for comes back."""
    import threading
    import time

    make = lambda: create_handler(  # noqa: E731
        RendezvousParameters(
            "etcd-v3",
            etcd_server.endpoint,
            unique_id,
            1,
            2,
            last_call_timeout="1",
            retry_timeout="10",
        )
    )
    a, b = make(), make()
    try:
        results: list[object] = []
        first = [
            threading.Thread(target=lambda h=h: results.append(h.next_rendezvous())) for h in (a, b)
        ]
        for t in first:
            t.start()
        for t in first:
            t.join(60)
        assert len(results) == 2
        restart = threading.Thread(target=lambda: results.append(a.next_rendezvous()))
        restart.start()  # a opens round 1 and waits for b, which is alive
        time.sleep(1.0)
        before = a._connection.requests  # type: ignore[attr-defined]
        time.sleep(4.0)
        polled = a._connection.requests - before  # type: ignore[attr-defined]
        assert restart.is_alive()
        b.next_rendezvous()
        restart.join(60)
        assert len(results) == 3
    finally:
        a.shutdown()
        b.shutdown()
    assert polled <= 8, f"{polled} etcd requests in 4 s of waiting"
