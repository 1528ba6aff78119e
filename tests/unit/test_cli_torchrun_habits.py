"""torchrun habits under `elastic-trainer run`: its flag spellings work, its other backends are
refused in one line, and a launcher flag after the script is pointed out."""

from __future__ import annotations

import pytest

from elastic_trainer import cli

EXAMPLE = ["-m", "elastic_trainer.examples.synthetic_cnn"]


def _dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["run", "--dry-run", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        (["--nproc_per_node", "3"], "--nproc-per-node=3"),
        (["--nproc-per-node=3"], "--nproc-per-node=3"),
        (["--rdzv_id", "job-9"], "--rdzv-id=job-9"),
        (["--rdzv-id", "job-9"], "--rdzv-id=job-9"),
        (["--max_restarts", "7"], "--max-restarts=7"),
        (["--rdzv-backend", "etcd-v3"], "--rdzv-backend=etcd-v3"),
        (["--standalone"], "--rdzv-backend=etcd-v3"),
    ],
)
def test_torchrun_spellings_are_accepted(
    capsys: pytest.CaptureFixture[str], spelling: list[str], expected: str
) -> None:
    code, out, err = _dry_run(capsys, *spelling, *EXAMPLE)
    assert code == 0, err
    assert expected in out.split()
    assert not err


def test_another_rendezvous_backend_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _dry_run(capsys, "--rdzv-backend", "c10d", *EXAMPLE)
    assert code == 2
    assert err.splitlines() == [
        "elastic-trainer: error: --rdzv-backend c10d: elastic-trainer run always uses "
        "etcd-v3 (drop the option, or use plain torchrun for other backends)"
    ]


def test_a_launcher_flag_after_the_script_is_pointed_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _dry_run(capsys, *EXAMPLE, "--max-steps", "3", "--nproc_per_node", "2")
    assert code == 0
    assert out.rstrip().endswith("--max-steps 3 --nproc_per_node 2"), "the script still gets it"
    assert err.splitlines() == [
        "elastic-trainer: warning: --nproc_per_node comes after the script, so the script "
        "gets it; if it is meant for elastic-trainer run, put it before the script"
    ]


def test_the_join_banner_never_sends_other_hosts_to_loopback() -> None:
    from elastic_trainer.launch.plan import join_banner

    loopback = join_banner("127.0.0.1:2379", "local-1", "127.0.0.1", address="10.1.2.3")
    assert (
        "loopback only: nodes on this host join with elastic-trainer run --rdzv-endpoint 127.0.0.1:2379 "
        "--run-id local-1" in loopback
    )
    assert (
        "for other hosts, start this node with --etcd-host 10.1.2.3 and join 10.1.2.3:PORT"
        in loopback
    )
    reachable = join_banner("10.1.2.3:2379", "local-1", "10.1.2.3")
    assert (
        "other nodes join with: elastic-trainer run --rdzv-endpoint 10.1.2.3:2379 --run-id local-1"
        in reachable
    )
    assert "127.0.0.1" not in reachable


@pytest.mark.parametrize("typo", ["--nproc-per-nod", "--max-restart"])
def test_an_abbreviated_flag_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], typo: str
) -> None:
    """argparse would take a prefix for the whole flag; a typo must not launch a job (issue 40)."""
    with pytest.raises(SystemExit) as exited:
        _dry_run(capsys, typo, "2", *EXAMPLE)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.splitlines() == [
        f"elastic-trainer: error: unrecognized arguments: {typo} (see elastic-trainer --help)"
    ], err
