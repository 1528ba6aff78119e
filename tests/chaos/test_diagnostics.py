"""``elastic-trainer debug`` on a real job across a heal (issue 42): 2 nodes x 2 workers under
``elastic-trainer run`` on a real etcd, and the same command for a plain torchrun job.

One job, in order: node b's ranks sleep inside their step (their stacks show the sleeping frame);
``debug profile`` gives one Chrome trace per rank holding the step's ops; a worker of node a is
SIGSTOPped (``debug stacks`` returns within 2 s, names it as not answering, shows the others'
frames); then it is SIGKILLed and the job heals in place (``debug stacks`` reaches the
replacement, not the dead process; the heal kept every survivor's stacks on disk).

    pytest tests/chaos/test_diagnostics.py
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_trainer.ops.debug import where_ranks_are
from elastic_trainer.ops.processes import wait_for
from rendezvous.etcd_server import free_port
from tests.chaos.faults import JobSpec, RunDirs, start_node, unique_run_id
from tests.support.agents import agents, start_agent, tails

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]

TITLE = re.compile(r"^rank (\d+) \(node (\S+), local (\d+), pid (\d+)\)(:.*)$")


def debug(endpoint: str, run_id: str, *words: str) -> tuple[int, str]:
    """``elastic-trainer debug WORDS``: its exit status and output."""
    done = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", "debug", *words,
         "--rdzv-endpoint", endpoint, "--run-id", run_id],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def ranks_of(output: str) -> dict[int, dict[str, object]]:
    """Each rank's pid, stack text (``None``: it did not answer) and the line said of it."""
    found: dict[int, dict[str, object]] = {}
    current: list[str] | None = None
    for line in output.splitlines():
        match = TITLE.match(line)
        if match:
            rank, pid, rest = int(match[1]), int(match[4]), match[5]
            current = [] if rest == ":" else None
            found[rank] = {"pid": pid, "stack": current, "line": line}
        elif current is not None and line.startswith("    "):
            current.append(line)
        else:
            current = None  # another block (a launcher's) or the summary
    return {r: {**v, "stack": None if v["stack"] is None else "\n".join(v["stack"])}
            for r, v in found.items()}  # fmt: skip


def asked_in(output: str) -> float:
    match = re.search(r"asked in ([\d.]+) s", output)
    assert match, output
    return float(match[1])


def test_debug_reaches_every_rank_across_a_heal(etcd_server, run_dirs: RunDirs) -> None:
    run_id = unique_run_id("debug")
    endpoint = etcd_server.endpoint
    job = JobSpec(epochs=40, throttle_ms=20)
    slow = run_dirs.root / "node-b-sleeps"
    slow.touch()
    metrics_port = free_port()
    with agents() as nodes:
        for name in ("a", "b"):
            env = (
                {"CHAOS_SLOW_WHILE_FILE": str(slow), "CHAOS_SLOW_MS": "400"} if name == "b" else {}
            )
            nodes.append(
                start_node(
                    name=name, run=run_dirs, job=job, endpoint=endpoint, run_id=run_id,
                    nnodes="2", nproc_per_node=2, env=env,
                    metrics_port=metrics_port if name == "a" else 0,
                    # The test SIGKILLs the stopped worker itself once `debug` has looked: the
                    # watchdog must not beat it to it while the command starts on a busy machine.
                    launch_options=("--frozen-timeout", "120"),
                )
            )  # fmt: skip
        wait_for(lambda: run_dirs.steps() >= 3, timeout=180, what="step 3",
                 describe=lambda: tails(nodes))  # fmt: skip

        # Node b's ranks sleep inside their step: a look at every rank shows that frame.
        def sleeping_seen() -> bool:
            code, out = debug(endpoint, run_id, "stacks")
            stacks = ranks_of(out)
            b_pids = set(nodes[1].worker_pids())
            return (
                code == 0
                and len(stacks) == 4
                and any(
                    "chaos_job.py" in str(v["stack"]) and " in hook" in str(v["stack"])
                    for v in stacks.values()
                    if v["pid"] in b_pids
                )
            )

        wait_for(sleeping_seen, timeout=60, what="a rank of node b seen sleeping in its step")
        slow.unlink()

        # The launchers answer too, after the ranks.
        code, out = debug(endpoint, run_id, "stacks")
        assert "4 rank(s) and 2 launcher(s)" in out, out
        for node in nodes:
            assert "launcher of node " in out and f"(pid {node.pid}):" in out, out
        # The same job from node a's metrics URL alone (top's --url): the same ranks.
        by_url = subprocess.run(
            [sys.executable, "-m", "elastic_trainer.cli", "debug", "stacks",
             "--url", f"127.0.0.1:{metrics_port}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert by_url.returncode == 0, by_url.stdout + by_url.stderr
        assert {v["pid"] for v in ranks_of(by_url.stdout).values()} == {
            v["pid"] for v in ranks_of(out).values()
        }, by_url.stdout

        # A profile of the next 3 steps on every rank: Chrome trace JSON with the step's ops.
        code, out = debug(
            endpoint, run_id, "profile", "--steps", "3", "--out", str(run_dirs.root / "prof")
        )
        assert code == 0, out
        traces = sorted((run_dirs.root / "prof").glob("rank*.profile.json"))
        assert len(traces) == 4, out
        for path in traces:
            events = json.loads(path.read_text())["traceEvents"]
            names = {e.get("name", "") for e in events}
            assert any(n.startswith("aten::") for n in names), path
            assert "c10d::allreduce_" in names, path  # the step's gradient allreduce

        # A stopped worker: named within the bound; the others answer with their frames.
        stopped = nodes[0].worker_pids()[-1]
        os.kill(stopped, signal.SIGSTOP)
        try:
            started = time.monotonic()
            code, out = debug(endpoint, run_id, "stacks")
            wall = time.monotonic() - started
            where = where_ranks_are(endpoint, run_id)  # what `top` shows of a stalled step
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)  # a worker SIGKILL: the job heals in place
        stacks = ranks_of(out)
        assert code == 1 and asked_in(out) <= 2.0, out
        assert wall < 30, out  # the interpreter's start and etcd's read besides
        silent = [r for r, v in stacks.items() if v["stack"] is None]
        assert [stacks[r]["pid"] for r in silent] == [stopped], out
        assert "no answer within 1.5 s" in str(stacks[silent[0]]["line"]), out
        others = [str(v["stack"]) for v in stacks.values() if v["stack"] is not None]
        assert len(others) == 3 and all("elastic_trainer/" in s for s in others), out
        assert len(where) == 4 and sum("no answer" in line for line in where) == 1, where
        assert sum(re.search(r"\.py:\d+ in \w+", line) is not None for line in where) == 3, where

        # After the heal: the replacement answers, not the dead process's address.
        def healed_and_answering() -> bool:
            code, out = debug(endpoint, run_id, "stacks")
            pids = {v["pid"] for v in ranks_of(out).values()}
            return code == 0 and len(pids) == 4 and stopped not in pids

        wait_for(healed_and_answering, timeout=120, what="every rank answering after the heal",
                 describe=lambda: tails(nodes))  # fmt: skip

        # The heal kept each survivor's stacks and flight recorder beside the checkpoints.
        folders = sorted((run_dirs.checkpoints / "diagnostics").glob("*-heal"))
        assert folders, tails(nodes)
        kept = sorted(folders[-1].glob("rank*.txt"))
        assert len(kept) == 3, kept  # the three survivors
        for path in kept:
            text = path.read_text()
            assert "== stacks" in text and "most recent call first" in text, text[:2000]
            assert "== flight recorder" in text, text[:2000]
        logs = "\n".join(n.log_path.read_text(errors="replace") for n in nodes)
        assert f"diagnostics of the heal in {folders[-1]}" in logs, logs[-4000:]
        # And the launchers' view of it (rank 0 asks them on a thread of its own).
        wait_for(lambda: len(list(folders[-1].glob("launcher-*.txt"))) == 2, timeout=30,
                 what="both launchers' view in the heal's folder")  # fmt: skip
        for path in folders[-1].glob("launcher-*.txt"):
            text = path.read_text()
            assert "== recent lines" in text and "== stacks" in text, text[:2000]
            assert "most recent call first" in text, text[:2000]


def test_debug_under_plain_torchrun(etcd_server, tmp_path: Path) -> None:
    """The same command for a job on the library's loop under plain torchrun ``etcd-v3``, before
    and after a restart; the restart's survivor keeps its evidence beside the checkpoints."""
    run_id = unique_run_id("debug-torchrun")
    ckpt = tmp_path / "ckpt"
    with agents() as started:
        agent = start_agent(
            endpoint=etcd_server.endpoint, run_id=run_id, log_path=tmp_path / "torchrun.log",
            job_args=["--epochs", "200", "--throttle-ms", "20", "--checkpoint-dir", str(ckpt)],
        )  # fmt: skip
        started.append(agent)

        def answering() -> bool:
            code, out = debug(etcd_server.endpoint, run_id, "stacks")
            stacks = ranks_of(out)
            return code == 0 and {v["pid"] for v in stacks.values()} == set(agent.worker_pids())

        wait_for(
            answering, timeout=180, what="both ranks answering", describe=lambda: tails(started)
        )
        code, out = debug(etcd_server.endpoint, run_id, "trace", "--out", str(tmp_path / "fr"))
        assert code == 0, out
        for rank in (0, 1):
            json.loads((tmp_path / "fr" / f"rank{rank}.trace.json").read_text())
        code, out = debug(etcd_server.endpoint, run_id, "dump", "--out", str(tmp_path / "dump"))
        assert code == 0, out
        for rank in (0, 1):
            assert (
                "most recent call first"
                in (tmp_path / "dump" / f"rank{rank}.stacks.txt").read_text()
            )
            json.loads((tmp_path / "dump" / f"rank{rank}.trace.json").read_text())
            assert isinstance(
                json.loads((tmp_path / "dump" / f"rank{rank}.waits.json").read_text()), dict
            )

        # A worker SIGKILL: torchrun restarts the group; the survivor kept its evidence, and
        # debug reaches the restarted processes.
        before = set(agent.worker_pids())
        agent.kill_worker(1)
        wait_for(
            lambda: answering() and not before & set(agent.worker_pids()),
            timeout=180, what="the restarted ranks answering", describe=lambda: tails(started),
        )  # fmt: skip
    kept = list((ckpt / "diagnostics").glob("*-restart/rank*.txt"))
    assert kept, tails(started)
    assert all("== stacks" in path.read_text() for path in kept)
