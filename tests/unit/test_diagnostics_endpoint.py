"""A worker's diagnostics endpoint in this process: torch's handler names answered by the stdlib
server, the profile of the next N steps run by the loop's ticks, evidence kept and pruned. The real
job: ``tests/chaos/test_diagnostics.py``."""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from elastic_trainer.train import diagnostics
from elastic_trainer.train.diagnostics import (
    RECENT_LINES,
    RecentLines,
    StepProfiler,
    capture_evidence,
    serve,
)

pytestmark = pytest.mark.timeout(60)


def post(url: str, name: str, timeout: float = 10) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{url}/handler/{name}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture
def endpoint():  # type: ignore[no-untyped-def]
    profiler = StepProfiler()
    server, url = serve("127.0.0.1", 0, profiler)
    try:
        yield url, profiler
    finally:
        server.shutdown()
        server.server_close()


def test_stacks_and_the_flight_recorder_by_torchs_names(endpoint) -> None:  # type: ignore[no-untyped-def]
    url, _ = endpoint
    status, body = post(url, "dump_traceback")
    assert status == 200 and b"most recent call first" in body
    assert b"test_stacks_and_the_flight_recorder_by_torchs_names" in body  # this thread waits in it
    status, body = post(url, "fr_trace_json")
    assert status == 200 and "version" in json.loads(body)
    assert post(url, "nothing")[0] == 404


def test_a_launchers_endpoint_answers_its_recent_lines_and_a_workers_does_not(endpoint) -> None:  # type: ignore[no-untyped-def]
    url, _ = endpoint
    assert post(url, "elastic_trainer_recent_lines")[0] == 404  # a worker's: no such handler
    recent = RecentLines()
    server, launcher = serve("127.0.0.1", 0, StepProfiler(), recent)
    logger = logging.getLogger("test.launcher")
    logger.addHandler(recent)
    try:
        for n in range(RECENT_LINES + 5):
            logger.warning("line %d", n)
        status, body = post(launcher, "elastic_trainer_recent_lines")
        lines = body.decode().splitlines()
        assert status == 200 and len(lines) == RECENT_LINES  # bounded: the newest kept
        assert lines[-1].endswith("test.launcher: line 204") and lines[0].endswith(": line 5")
    finally:
        logger.removeHandler(recent)
        server.shutdown()
        server.server_close()


def test_a_profile_covers_the_next_steps_the_loop_ticks(endpoint) -> None:  # type: ignore[no-untyped-def]
    url, profiler = endpoint
    answer: list[tuple[int, bytes]] = []
    asking = threading.Thread(
        target=lambda: answer.append(post(url, "elastic_trainer_profile?steps=2&timeout=20", 30))
    )
    asking.start()
    ticks = 0
    while asking.is_alive() and ticks < 2000:  # the loop: a step's work, then the next start
        profiler.tick()
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
        ticks += 1
        asking.join(0.005)
    asking.join(30)
    [(status, body)] = answer
    assert status == 200, body[:200]
    names = {event.get("name") for event in json.loads(body)["traceEvents"]}
    assert "aten::mm" in names
    assert profiler._profile is None and not profiler._wanted  # idle again: one read per tick


def test_a_profile_nobody_ticks_for_ends_at_its_timeout(endpoint) -> None:  # type: ignore[no-untyped-def]
    url, profiler = endpoint
    status, body = post(url, "elastic_trainer_profile?steps=3&timeout=0.2")
    assert status == 503 and b"did not end in time" in body
    assert not profiler._wanted  # withdrawn: a later tick starts nothing
    assert post(url, "elastic_trainer_profile?steps=0")[0] == 400


def test_evidence_is_kept_and_the_newest_folders_stay(tmp_path: Path) -> None:
    profiler = StepProfiler()
    server, url = serve("127.0.0.1", 0, profiler)
    keeper = diagnostics.Diagnostics(  # not registered: no etcd, so no launchers' view either
        server, url, "a", 0, profiler, None, None, owns_connection=False
    )
    evidence = capture_evidence("http://127.0.0.1:1", "rank 0 of 2: a test")
    assert "== stacks" in evidence and "== flight recorder" in evidence
    for epoch in range(diagnostics.KEEP_EVIDENCE + 3):
        keeper.keep_evidence(str(tmp_path), f"{epoch:06d}-heal", 0, evidence)
    kept = sorted(p.name for p in (tmp_path / diagnostics.EVIDENCE_DIR).iterdir())
    assert kept == [f"{e:06d}-heal" for e in range(3, diagnostics.KEEP_EVIDENCE + 3)]
    assert (tmp_path / diagnostics.EVIDENCE_DIR / kept[-1] / "rank0.txt").read_text() == evidence
    keeper.keep_evidence(None, "x", 0, evidence)  # no checkpoint directory: nothing written
    keeper.close()
