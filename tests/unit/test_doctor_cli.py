"""doctor's command line: defaults, validation, one-line errors with exit status 2."""

from __future__ import annotations

import pytest

from elastic_trainer.doctor import main as doctor
from elastic_trainer.doctor.main import DoctorOptions, parse_args
from elastic_trainer.runtime.failures import UserError

pytestmark = pytest.mark.timeout(30)


def test_defaults() -> None:
    options = parse_args([])
    assert options.sizes[0] == 1 << 10 and options.sizes[-1] == 64 << 20
    assert (options.iters, options.warmup, options.json) == (20, 5, False)
    assert options.timeout_s == 60 and options.deadline_s == 300


def test_flags() -> None:
    options = parse_args(
        [
            "--json",
            "--sizes",
            "1K,64K",
            "--iters",
            "3",
            "--warmup",
            "0",
            "--batch-size",
            "8",
            "--timeout",
            "5",
            "--deadline",
            "30",
        ]
    )
    assert options == DoctorOptions(
        json=True,
        sizes=[1024, 65536],
        iters=3,
        warmup=0,
        batch_size=8,
        timeout_s=5.0,
        deadline_s=30.0,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--sizes", "6"], "multiple of 4"),
        (["--sizes", "1K..64M:1"], "factor"),
        (["--iters", "0"], "--iters: must be in 1..10000, got 0"),
        (["--iters", "many"], "invalid int value: 'many'"),
        (["--warmup", "-1"], "--warmup: must be in 0..10000"),
        (["--batch-size", "0"], "--batch-size: must be in 1..65536"),
        (["--timeout", "0"], "must be a positive number of seconds"),
        (["--timeout", "inf"], "must be a positive number of seconds"),
        (
            ["--timeout", "60", "--deadline", "30"],
            "--deadline: must exceed the timeout (60 s), got 30",
        ),
    ],
)
def test_bad_flags_raise_usage_error(argv: list[str], message: str) -> None:
    with pytest.raises(UserError) as caught:
        parse_args(argv)
    assert message in str(caught.value)


def test_main_bad_flag_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert doctor.main(["--iters", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "elastic-trainer doctor: error: --iters: must be in 1..10000, got 0\n"


def test_main_bad_flag_is_reported_by_rank_0_only(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    assert doctor.main(["--bogus"]) == 2
    assert capsys.readouterr().err == ""


def test_main_unknown_fault_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("ELASTIC_TRAINER_DOCTOR_FAULT", "disk")
    assert doctor.main([]) == 2
    assert "ELASTIC_TRAINER_DOCTOR_FAULT: unknown fault 'disk'" in capsys.readouterr().err


def test_help_exits_zero_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "torchrun --standalone --nproc-per-node=2 -m elastic_trainer.doctor" in out
    assert "ELASTIC_TRAINER_DOCTOR_FAULT" in out


def test_options_validate_directly() -> None:
    with pytest.raises(ValueError, match="sizes"):
        DoctorOptions(sizes=[])


def test_the_deadline_reports_what_was_found_then_ends_the_process(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    exits: list[int] = []
    monkeypatch.setattr(doctor.os, "_exit", exits.append)
    stuck = doctor.Doctor(DoctorOptions(), {}, frozenset())
    stuck.current = "allreduce"
    doctor._expire(stuck)
    assert exits == [1]
    out, err = capsys.readouterr()
    assert "deadline of 300 s exceeded in the allreduce check" in err
    assert "did not finish within --deadline=300s" in out and "PARTIAL REPORT" in out
    doctor._expire(stuck)  # the run printed first: the timer only ends the process
    assert exits == [1, 1] and capsys.readouterr() == ("", "")
