"""doctor's report: merging per-rank results, cross-rank findings, text and JSON rendering."""

from __future__ import annotations

import json

import pytest

from elastic_trainer.doctor.report import (
    CHECKS,
    FAIL,
    PASS,
    SKIP,
    WARN,
    CheckResult,
    RankReport,
    bandwidth_table,
    cross_rank_findings,
    format_size,
    merge,
    render_json,
    render_text,
    worst,
)

pytestmark = pytest.mark.timeout(30)


def env(
    rank: int,
    *,
    world: int = 2,
    local: int | None = None,
    lws: int = 2,
    group: int = 0,
    **extra: str,
) -> dict:
    values = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank if local is None else local),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(lws),
        "GROUP_RANK": str(group),
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job",
    }
    values.update(extra)
    return values


def report(
    rank: int,
    *results: CheckResult,
    host: str = "node0",
    device: str = "cpu",
    facts: dict | None = None,
    **env_kw,
) -> RankReport:  # type: ignore[no-untyped-def]
    base = {
        "env": env(rank, **env_kw),
        "torch_version": "2.13.0",
        "nccl_version": None,
        "backend": "gloo",
        "timeouts_env": {},
    }
    base.update(facts or {})
    return RankReport(rank=rank, host=host, device=device, facts=base, results=list(results))


def ok(name: str, detail: str = "fine") -> CheckResult:
    return CheckResult(name=name, status=PASS, detail=detail)


def test_check_result_validates_name_and_status() -> None:
    with pytest.raises(ValueError, match="name"):
        CheckResult(name="nope", status=PASS, detail="")
    with pytest.raises(ValueError, match="status"):
        CheckResult(name="env", status="OK", detail="")


def test_worst_orders_pass_skip_warn_fail() -> None:
    assert worst([PASS, SKIP]) == SKIP
    assert worst([PASS, WARN, SKIP]) == WARN
    assert worst([WARN, FAIL, PASS]) == FAIL
    assert worst([]) == PASS


def test_all_pass_merges_to_pass_with_exit_zero() -> None:
    merged = merge([report(r, ok("env"), ok("allreduce")) for r in (1, 0)])
    assert [r.status for r in merged.results] == [PASS, PASS]
    assert merged.ok and merged.ranks == 2


def test_one_failing_rank_fails_the_check_and_is_named() -> None:
    bad = CheckResult(name="placement", status=FAIL, detail="batch on meta")
    merged = merge([report(0, ok("placement")), report(1, bad)])
    (result,) = merged.results
    assert result.status == FAIL
    assert result.detail == "rank 1: batch on meta"
    assert result.data["ranks"] == {PASS: [0], FAIL: [1]}
    assert not merged.ok


def test_identical_failures_are_grouped() -> None:
    bad = CheckResult(name="allreduce", status=FAIL, detail="sum is 2, expected 1")
    merged = merge([report(r, bad) for r in range(3)], world_size=3)
    assert merged.results[0].detail == "ranks 0,1,2: sum is 2, expected 1"


def test_warn_does_not_fail_the_run() -> None:
    warn = CheckResult(name="timeouts", status=WARN, detail="heartbeat below timeout")
    merged = merge([report(0, warn), report(1, ok("timeouts"))])
    assert merged.status == WARN and merged.ok


def test_results_follow_the_check_order() -> None:
    merged = merge([report(0, ok("compute_comm"), ok("env"), ok("allreduce"))], world_size=1)
    assert [r.name for r in merged.results] == ["env", "allreduce", "compute_comm"]
    assert list(CHECKS)[0] == "env"


def test_consistent_ranks_have_no_cross_rank_findings() -> None:
    reports = [report(r, local=r % 2, group=r // 2, world=4) for r in range(4)]
    assert cross_rank_findings(reports) == []


def test_duplicate_rank_is_an_env_failure() -> None:
    reports = [report(0), report(1, facts={"env": env(0)})]
    (finding,) = [f for f in cross_rank_findings(reports) if f.name == "env"]
    assert finding.status == FAIL and "RANK 0 used by more than one process" in finding.detail


def test_world_size_disagreeing_with_the_ranks_that_joined() -> None:
    reports = [report(0, world=3, lws=3), report(1, world=3, lws=3)]
    (finding,) = cross_rank_findings(reports)
    assert "WORLD_SIZE=3 but 2 ranks joined" in finding.detail


def test_different_run_ids_are_an_env_failure() -> None:
    reports = [report(0), report(1, facts={"env": env(1, TORCHELASTIC_RUN_ID="other")})]
    (finding,) = cross_rank_findings(reports)
    assert finding.name == "env" and "TORCHELASTIC_RUN_ID differs" in finding.detail


def test_local_world_size_must_match_ranks_per_node() -> None:
    reports = [report(r, local=r, lws=3) for r in range(2)]
    details = " ".join(f.detail for f in cross_rank_findings(reports))
    assert "GROUP_RANK=0 has 2 ranks but LOCAL_WORLD_SIZE=3" in details


def test_two_ranks_on_one_gpu_of_one_host_fail_devices() -> None:
    reports = [report(0, device="cuda:0"), report(1, device="cuda:0")]
    (finding,) = cross_rank_findings(reports)
    assert finding.name == "devices" and finding.status == FAIL
    assert "ranks 0,1 share cuda:0 on node0" in finding.detail


def test_same_gpu_index_on_different_hosts_is_fine() -> None:
    reports = [
        report(0, device="cuda:0", host="a", local=0, group=0, lws=1),
        report(1, device="cuda:0", host="b", local=0, group=1, lws=1),
    ]
    assert cross_rank_findings(reports) == []


def test_different_torch_versions_warn_on_backend() -> None:
    reports = [report(0), report(1, facts={"torch_version": "2.12.0"})]
    (finding,) = cross_rank_findings(reports)
    assert (
        finding.name == "backend"
        and finding.status == WARN
        and "torch version differs" in finding.detail
    )


def test_different_timeout_settings_warn() -> None:
    reports = [
        report(0, facts={"timeouts_env": {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600"}}),
        report(1),
    ]
    (finding,) = cross_rank_findings(reports)
    assert finding.name == "timeouts" and finding.status == WARN


def test_cross_rank_finding_turns_a_passing_check_into_a_failure() -> None:
    reports = [report(0, ok("devices"), device="cuda:0"), report(1, ok("devices"), device="cuda:0")]
    merged = merge(reports)
    assert merged.results[0].status == FAIL and "share cuda:0" in merged.results[0].detail


def test_format_size() -> None:
    assert [format_size(s) for s in (6, 1024, 64 << 20, 1 << 30, 1536)] == [
        "6 B",
        "1 KiB",
        "64 MiB",
        "1 GiB",
        "1536 B",
    ]


ROWS = [
    {"size_bytes": 1024, "count": 256, "time_us": 25.0, "algbw_gbps": 0.041, "busbw_gbps": 0.041},
    {
        "size_bytes": 64 << 20,
        "count": 16 << 20,
        "time_us": 9000.0,
        "algbw_gbps": 7.46,
        "busbw_gbps": 7.46,
    },
]


def test_bandwidth_table_has_the_nccl_tests_columns() -> None:
    header, first, last = bandwidth_table(ROWS)
    assert header.split() == ["size", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)"]
    assert first.split() == ["1", "KiB", "256", "25.0", "0.041", "0.041"]
    assert last.split()[:2] == ["64", "MiB"]


def test_render_text_lists_checks_table_and_verdict() -> None:
    bandwidth = CheckResult(
        name="bandwidth",
        status=PASS,
        detail="2 sizes",
        data={"rows": ROWS, "iters": 3, "warmup": 1},
    )
    bad = CheckResult(name="allreduce", status=FAIL, detail="sum is 2")
    text = render_text(merge([report(0, ok("env"), bad, bandwidth)], world_size=1))
    lines = text.splitlines()
    assert lines[0].startswith("elastic-trainer doctor: 1 rank(s) on 1 node(s), backend gloo")
    assert any(line.startswith("FAIL  allreduce") and line.endswith("sum is 2") for line in lines)
    assert any(line.startswith("PASS  env") for line in lines)
    assert any("busbw(GB/s)" in line for line in lines)
    assert lines[-1] == "RESULT: FAIL (1 FAIL, 2 PASS)"


def test_render_text_marks_a_partial_report() -> None:
    merged = merge([report(0, ok("env"))], partial="peers unreachable", world_size=4)
    text = render_text(merged)
    assert "1 of 4 rank(s)" in text and "PARTIAL REPORT: peers unreachable" in text


def test_render_json_is_machine_readable() -> None:
    warn = CheckResult(name="compute_comm", status=WARN, detail="comm-bound", data={"ratio": 0.5})
    document = json.loads(
        render_json(merge([report(0, ok("env"), warn), report(1, ok("env"), warn)]))
    )
    assert document["ok"] is True and document["status"] == WARN and document["ranks"] == 2
    assert [c["name"] for c in document["checks"]] == ["env", "compute_comm"]
    assert document["checks"][1]["data"]["ratio"] == 0.5
    assert document["checks"][0]["title"] == CHECKS["env"]


def test_injected_faults_are_announced() -> None:
    merged = merge([report(0, ok("env"), facts={"faults": ["allreduce"]}), report(1, ok("env"))])
    assert merged.faults == ["allreduce"]
    assert "SELF-TEST: faults injected on the last rank: allreduce" in render_text(merged)
    assert json.loads(render_json(merged))["faults"] == ["allreduce"]
