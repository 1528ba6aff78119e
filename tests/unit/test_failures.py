"""Worker failure classification (elastic_trainer.runtime.failures) and the launcher's restart decision
(elastic_trainer.launch.failure_policy), on real exceptions and torch's real ProcessFailure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastic_trainer.checkpoint.files import CheckpointMismatchError, CheckpointWriteError
from elastic_trainer.launch.failure_policy import FailurePolicy
from elastic_trainer.runtime import failures
from elastic_trainer.runtime.failures import ConfigError, FailureClass, classify
from elastic_trainer.train.config import TrainerConfig


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - a real traceback for the signature
        return caught


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (SyntaxError("invalid syntax", ("train.py", 3, 1, "x = (")), FailureClass.DETERMINISTIC),
        (ModuleNotFoundError("No module named 'missing'"), FailureClass.DETERMINISTIC),
        (
            CheckpointMismatchError("checkpoint x belongs to a different job"),
            FailureClass.DETERMINISTIC,
        ),
        (
            CheckpointWriteError("could not write: the disk is full (errno 28)"),
            FailureClass.DETERMINISTIC,
        ),
        (SystemExit(2), FailureClass.DETERMINISTIC),
        (
            RuntimeError(
                "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
            ),
            FailureClass.TRANSIENT,
        ),
        (dist.DistNetworkError("peer gone"), FailureClass.TRANSIENT),
        (ZeroDivisionError("division by zero"), FailureClass.ERROR),
        (SystemExit(3), FailureClass.ERROR),
    ],
)
def test_classification(exc: BaseException, expected: FailureClass) -> None:
    assert failures.classify(_raised(exc))[0] is expected


def test_an_invalid_trainer_config_is_deterministic() -> None:
    with pytest.raises(ConfigError) as info:
        TrainerConfig(global_batch_size=0)
    assert isinstance(info.value, ValueError)
    assert failures.classify(info.value) == (
        FailureClass.DETERMINISTIC,
        "global_batch_size: must be a positive integer, got 0",
    )


def test_the_record_is_torchs_error_file_and_torch_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(failures, "_recorded", False)
    error_file = tmp_path / "error.json"
    exc = _raised(ZeroDivisionError("division by zero"))
    failures.note_step(exc, 3)
    report = failures.report_of(exc, rank=1)
    assert failures.record(report, error_file=str(error_file))
    data = json.loads(error_file.read_text())
    assert data["errorTraits"] == {"category": "error", "retryability": "True"}
    torch_view = ProcessFailure(local_rank=1, pid=123, exitcode=1, error_file=str(error_file))
    assert torch_view.message["message"] == "ZeroDivisionError: division by zero (in step 3)"
    assert "ZeroDivisionError" in torch_view.message["extraInfo"]["py_callstack"]
    assert failures.read_report(torch_view.error_file_data) == report
    # Once per process: a second failure (the teardown's) does not replace the root cause.
    assert failures.record(failures.report_of(_raised(KeyError("x"))), error_file=str(error_file))
    assert failures.read_report(json.loads(error_file.read_text())) == report


def test_exit_after_leaves_a_mistake_to_the_launcher_and_says_it_once_a_node_without(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 40 item 5: under ``elastic-trainer run`` the launcher says the root cause once, so a
    rank says nothing of a mistake or an error; under plain torchrun the first rank of the node's
    attempt says it (torchrun's per-rank error files share one folder an attempt), once, and an
    error's traceback holds none of the library's frames. A transient failure: a line a rank."""
    monkeypatch.setattr(failures, "_recorded", False)
    monkeypatch.setenv("ELASTIC_TRAINER_REPORTS_FAILURES", "1")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert (
        failures.exit_after(_raised(ZeroDivisionError("division by zero")), prog="job")
        == failures.EXIT_FAILED
    )
    assert failures.exit_after(_raised(ConfigError("--width: must be positive")), prog="job") == 2
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("ELASTIC_TRAINER_REPORTS_FAILURES")
    attempt = tmp_path / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
        target = failures.ReportTarget(rank=rank, error_file=str(attempt / str(rank) / "e.json"))
        failures._recorded = False
        mistake = _raised(ConfigError("--width: must be positive"))
        assert failures.exit_after(mistake, prog="job", target=target) == 2
    assert capsys.readouterr().err == "job: error: --width: must be positive (rank 0)\n"
    failures.exit_after(_raised(ZeroDivisionError("division by zero")), prog="job")
    said = capsys.readouterr().err
    assert said.startswith("Traceback (most recent call last)") and "ZeroDivisionError" in said
    assert "elastic_trainer" not in said.replace(str(Path(__file__)), ""), said


def test_a_traceback_keeps_the_library_frames_when_the_error_is_raised_in_them() -> None:
    """A bug of the library's own is not hidden: its frames stay when the innermost is one."""
    try:
        failures.ReportTarget.from_environ(environ=None).__class__(rank="x").rank.bit_length()
    except AttributeError as exc:
        user = failures.users_traceback(exc)
    assert "test_failures.py" in user
    try:
        failures.message_line(None)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - whatever the library raises for it
        inside = failures.users_traceback(exc)
        assert "elastic_trainer/runtime/failures.py" in inside, inside


# -- the policy, on torch's own ProcessFailure read from real error files ---------------------------------
def _failure(
    tmp_path: Path,
    rank: int,
    exc: BaseException | None,
    *,
    exitcode: int = 1,
    step: int | None = None,
    at: float = 0.0,
) -> ProcessFailure:
    path = tmp_path / f"error-{rank}-{at}.json"
    if exc is not None:
        raised = _raised(exc)
        if step is not None:
            failures.note_step(raised, step)
        report = failures.report_of(raised, rank=rank)
        object.__setattr__(report, "time", 1000.0 + at)
        failures._recorded = False
        failures.record(report, error_file=str(path))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_a_deterministic_failure_stops_at_once_and_names_the_earliest(tmp_path: Path) -> None:
    policy = FailurePolicy()
    verdict = policy.judge(
        {
            1: _failure(tmp_path, 1, RuntimeError("Connection closed by peer"), at=2),
            0: _failure(
                tmp_path,
                0,
                CheckpointWriteError("could not write the checkpoint: the disk is full"),
                exitcode=2,
                at=1,
            ),
        }
    )
    assert not verdict.restart and verdict.root_cause.rank == 0 and verdict.exit_code == 2
    assert verdict.reason == (
        "rank 0 failed: could not write the checkpoint: the disk is full; a restart cannot fix this"
    )
    assert verdict.traceback is None


def test_an_error_gets_one_restart_and_stops_when_it_repeats_at_the_same_step(
    tmp_path: Path,
) -> None:
    policy = FailurePolicy()

    def step3() -> ZeroDivisionError:
        return ZeroDivisionError("division by zero")  # raised from the same line each time

    first = policy.judge({0: _failure(tmp_path, 0, step3(), step=3, at=1)})
    assert first.restart and "ZeroDivisionError" in first.reason
    again = policy.judge({0: _failure(tmp_path, 0, step3(), step=3, at=2)})
    assert not again.restart and again.exit_code == 1
    assert "again after a restart" in again.reason
    assert again.traceback is not None and again.traceback.startswith("Traceback")


def test_the_same_error_at_another_step_is_given_another_restart(tmp_path: Path) -> None:
    policy = FailurePolicy()
    assert policy.judge({0: _failure(tmp_path, 0, ZeroDivisionError("x"), step=3, at=1)}).restart
    assert policy.judge({0: _failure(tmp_path, 0, ZeroDivisionError("x"), step=9, at=2)}).restart


def test_signals_and_unexplained_exits_are_transient_and_exit_2_is_not(tmp_path: Path) -> None:
    policy = FailurePolicy()
    killed = policy.judge({1: _failure(tmp_path, 1, None, exitcode=-9)})
    assert killed.restart and killed.reason == "rank 1 failed: killed by SIGKILL"
    assert policy.judge({1: _failure(tmp_path, 1, None, exitcode=1)}).restart
    usage = policy.judge({0: _failure(tmp_path, 0, None, exitcode=2)})
    assert not usage.restart and "status 2" in usage.reason


def test_a_killed_rank_is_the_root_cause_rather_than_the_ranks_whose_collectives_failed(
    tmp_path: Path,
) -> None:
    policy = FailurePolicy()
    verdict = policy.judge(
        {
            1: _failure(
                tmp_path, 1, RuntimeError("Connection closed by peer"), at=0
            ),  # recorded before the agent saw 0
            0: _failure(tmp_path, 0, None, exitcode=-9),
        }
    )
    assert (
        verdict.restart
        and verdict.root_cause.rank == 0
        and verdict.reason == "rank 0 failed: killed by SIGKILL"
    )


def test_a_rank_the_agent_terminated_is_not_the_root_cause_of_a_killed_peer(tmp_path: Path) -> None:
    """rank 1 SIGKILLed; the agent SIGTERMs rank 0 before rank 0 recorded its failed collective.
    Both failures have no record and the same (whole-second) timestamp: the SIGKILL is the cause."""
    policy = FailurePolicy()
    verdict = policy.judge(
        {0: _failure(tmp_path, 0, None, exitcode=-15), 1: _failure(tmp_path, 1, None, exitcode=-9)}
    )
    assert verdict.root_cause.rank == 1 and verdict.reason == "rank 1 failed: killed by SIGKILL"
    alone = policy.judge(
        {0: _failure(tmp_path, 0, None, exitcode=-15)}
    )  # a SIGTERM on its own is still the cause
    assert alone.root_cause.rank == 0 and alone.reason == "rank 0 failed: killed by SIGTERM"


@pytest.mark.parametrize(
    "message",
    [
        "heal: the process group was aborted (round 3 opened)",
        "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234",
        "ProcessGroupGloo::allreduce: Connection reset by peer",
        "NCCL communicator was aborted on rank 1",
        "Socket Timeout",
    ],
)
def test_did_a_peer_die_has_one_answer(message: str) -> None:
    """The launcher's failure class and the healer ask the same function (one marker list)."""
    from elastic_trainer.runtime import failures

    assert failures.is_collective_failure(RuntimeError(message))
    assert failures.classify(RuntimeError(message))[0] is failures.FailureClass.TRANSIENT
    assert failures.is_collective_failure(
        failures.GroupAborted("a heal round after epoch 2 is open")
    )
    assert not failures.is_collective_failure(ValueError(message)), (
        "a bug in the step is not a dead peer"
    )


@pytest.mark.parametrize(
    "message",
    [  # what torch 2.13's gloo says to a wrong call (checked with a one-rank group)
        "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (3), got (2))",
        "ProcessGroupGloo::allgather: invalid output tensor list at index 0 (expected length 1, got 2)",
        "ProcessGroupGloo::broadcast: invalid root rank: 3",
        "[rank0]:[F1129 02:13:05.034805313 ProcessGroupGloo.cpp:1537] Check failed: "
        "outputShape[0] * worldSize == inputShape[0] (2 vs. 5). ",
        "NCCL error in: ProcessGroupNCCL.cpp:1971, invalid usage (run with NCCL_DEBUG=WARN)",
    ],
)
def test_a_collective_refusing_its_arguments_is_not_a_dead_peer(message: str) -> None:
    """A user's bug in a collective's arguments names the process group, but no peer died and a
    restart meets it again: an error of the user's code, shown as such (not "a peer died")."""
    from elastic_trainer.runtime import failures

    assert not failures.is_collective_failure(RuntimeError(message))
    assert failures.classify(RuntimeError(message))[0] is failures.FailureClass.ERROR
    # With evidence of a lost peer in the same message, it is one again.
    lost = RuntimeError(f"{message}: Connection reset by peer")
    assert failures.is_collective_failure(lost)


def test_a_distributed_sampler_before_the_group_is_a_setup_mistake_naming_elastic_sampler() -> None:
    """torch's own error for a DistributedSampler built before the runtime formed the group:
    deterministic (exit 2, no restart spent), one line that names ElasticSampler."""
    exc = ValueError(
        "Default process group has not been initialized, please make sure to call init_process_group."
    )
    failure_class, summary = classify(exc)
    assert failure_class is FailureClass.DETERMINISTIC
    assert "ElasticSampler" in summary and "DistributedSampler" in summary and "\n" not in summary


def test_a_wrong_argument_to_a_public_class_is_a_setup_mistake() -> None:
    from elastic_trainer import Elastic, TrainerConfig

    with pytest.raises(TypeError) as caught:
        TrainerConfig()  # type: ignore[call-arg]  # global_batch_size is required
    failure_class, summary = classify(caught.value)
    assert failure_class is FailureClass.DETERMINISTIC
    assert summary.startswith("TrainerConfig(...) missing 1 required keyword-only argument"), (
        summary
    )
    # Elastic's settings are checked at its edge: one line that names the missing one
    with pytest.raises(ConfigError) as refused:
        Elastic(object(), [])  # type: ignore[arg-type]
    assert classify(refused.value)[0] is FailureClass.DETERMINISTIC
    assert str(refused.value) == (
        "Elastic: global_batch_size= is required (samples per step, all ranks)"
    )
    # the same kind of TypeError from anybody else's class is the user's code: an ERROR, retried once
    assert (
        classify(TypeError("Foo.__init__() missing 1 required positional argument: 'x'"))[0]
        is FailureClass.ERROR
    )
