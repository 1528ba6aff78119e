"""The GPU check's parts without a GPU: each parser on the output its benchmark prints (taken from
real runs), the verdicts and the table, and the runner's limits, budget and exit status on small
commands. The whole script's CPU dry run is tests/integration/test_gpu_check_dry_run.py.

    pytest tests/unit/test_gpu_check.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from benchmarks.gpu_check import __main__ as gpu_check
from benchmarks.gpu_check import node, parsers, report, runner
from benchmarks.gpu_check.plan import PLAN, Claim, Plan, Step, Target
from benchmarks.gpu_check.runner import StepResult

pytestmark = pytest.mark.timeout(120)

OVERHEAD_E2E = """\
gpt, bf16 autocast, global batch 8; 1 x NVIDIA H100 80GB HBM3, NCCL; load average at the end: 1.2 (16 cores)
| variant | samples/s (median) | ratio vs bare | CPU-us per sample, both ranks (median) | CPU ratio vs bare | step ms p50 | p99 | max |
|---|---:|---:|---:|---:|---:|---:|---:|
| bare | 1237.3 | 1.000 | 792.4 | 1.000 | 3.20 | 3.48 | 3.48 |
| defaults | 988.7 | 0.799 | 1257.8 | 1.587 | 2.72 | 7.69 | 7.69 |
"""

METRICS_OVERHEAD = """\
run  load wall ms/step node CPU ms/step CPU on/off median       CPU on/off mean        A/A CPU mean wall on/off median A/A wall median
  1   4.1        33.16             3.14            0.9580        0.9537 +- 0.0166      1.0240 +- 0.0128             0.9176          0.9877
CPU on/off, median d: 0.9580 (runs 0.9580-0.9580)
CPU on/off, mean d:   0.9537 (runs 0.9537-0.9537)   A/A: 1.0240 (runs 1.0240-1.0240)
wall on/off, median d: 0.9176 (runs 0.9176-0.9176)
"""

CHECKPOINT_STALL = """\
| mode | on-thread stall per checkpoint, s (median) | effective cost per checkpoint, s |
|---|---:|---:|
| sync | 2.105 | 1.173 |
| async | 0.065 | 1.332 |

on-thread stall ratio async/sync: 0.031
effective cost ratio async/sync: 1.136
"""

SHARDED_STALL = """\
state per rank: 201 MB (params + AdamW), 2 ranks on cpu, 3 saves per run, 2 repeats
async: on-thread stall median 220.7 ms (first save 481.0 ms), effective cost per save 812.4 ms
 sync: on-thread stall median 6228.7 ms (first save 6301.2 ms), effective cost per save 6250.0 ms
async stall / sync stall: 3.5 % (target <= 5 %)
"""
SHARDED_STEADY = """\
bare: CPU per step (all ranks) median 15.66 ms, wall per step median 41.62 ms
ours: CPU per step (all ranks) median 16.15 ms, wall per step median 39.04 ms
ours / bare: CPU 1.031x (target <= 1.03), throughput 1.066
"""
RESTART_COST = """\
| phase | restart (s) | in place (s) | restart / in place | restart CPU (s) | in place CPU (s) |
|---|---:|---:|---:|---:|---:|
| 4. training state | 0.441 | 1.078 | 0.4x | 0.428 | 1.080 |
| **total** | 1.517 | 1.087 | 1.4x | 1.597 | 1.082 |
"""

# `launcher_e2e --workloads gpt --variants bare/torchrun trainer/elastic --tiny --nproc 1` on this
# CPU machine (the dry run's step; a GPU run prints the same tables), --pairs 1 and --pairs 3.
LAUNCHER_E2E_1 = """\
launcher_e2e: 1 cpu worker(s) per run; tiny sizes: a wiring check, no measurement
| workload | variant | steps/s (median; min-max) | ratio | CPU ms/step | CPU ratio | first step s | first step - baseline s | script start s | threads | hooks | control |
|---|---|---|---|---|---|---|---|---|---|---|---|
| gpt | bare/torchrun | 729.85 (729.85-729.85) | 1.000 | 1.36 | 1.000 | 8.06 | +0.00 | 1.5 | 4 | 0 | - |
| gpt | trainer/elastic | 534.37 (534.37-534.37) | 0.732 | 1.86 | 1.368 | 6.00 | -2.06 | 5.8 | 14 | 0 | collective |
| gpt | pairs | 1 | | | | | | | | | |

| workload | variant | samples/s (median) | tokens/s (median) |
|---|---|---|---|
| gpt | bare/torchrun | 1459.7 | 23355 |
| gpt | trainer/elastic | 1068.7 | 17100 |

fewer than 3 pairs: no claim (a claim is the median of >= 3)
"""
LAUNCHER_E2E_3 = """\
launcher_e2e: 1 cpu worker(s) per run; tiny sizes: a wiring check, no measurement
| workload | variant | steps/s (median; min-max) | ratio | CPU ms/step | CPU ratio | first step s | first step - baseline s | script start s | threads | hooks | control |
|---|---|---|---|---|---|---|---|---|---|---|---|
| gpt | bare/torchrun | 528.39 (150.75-682.74) | 1.000 | 1.41 | 1.000 | 9.82 | +0.00 | 4.3 | 4 | 0 | - |
| gpt | trainer/elastic | 104.84 (100.99-116.37) | 0.198 | 2.72 | 1.935 | 8.03 | -0.65 | 7.8 | 14 | 0 | collective |
| gpt | pairs | 3 | | | | | | | | | |

| workload | variant | samples/s (median) | tokens/s (median) |
|---|---|---|---|
| gpt | bare/torchrun | 1056.8 | 16909 |
| gpt | trainer/elastic | 209.7 | 3355 |
"""
_TINY_LINE = "launcher_e2e: 1 cpu worker(s) per run; tiny sizes: a wiring check, no measurement\n"

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_cuda_nccl" name="test_a" time="1"/>
<testcase classname="tests.gpu.test_cuda_nccl" name="test_heal" time="0">
  <skipped type="pytest.skip" message="needs 2 GPUs for two NCCL ranks, found 1">...</skipped></testcase>
<testcase classname="tests.gpu.test_no_device_wait_cuda" name="test_b" time="1">
  <failure message="AssertionError">...</failure></testcase>
<testcase classname="tests.gpu.test_no_device_wait_cuda" name="test_c" time="0">
  <skipped type="pytest.skip" message="needs CUDA (gpu marker)">...</skipped></testcase>
</testsuite></testsuites>
"""


def test_overhead_e2e_reads_the_defaults_row_not_the_bare_one() -> None:
    figures = parsers.overhead_e2e(OVERHEAD_E2E, Path("."))
    assert figures["wall_ratio"].value == 0.799 and figures["cpu_ratio"].value == 1.587
    assert (
        "988.7 samples/s" in figures["wall_ratio"].text
        and "p99 7.69 ms" in figures["wall_ratio"].text
    )


def test_launcher_e2e_reads_the_trainer_row_its_cpu_ratio_and_both_throughputs() -> None:
    figures = parsers.launcher_e2e(LAUNCHER_E2E_1, Path("."))
    assert (figures["wall_ratio"].value, figures["cpu_ratio"].value) == (0.732, 1.368)
    assert (
        figures["wall_ratio"].text
        == "0.732 (17100 vs 23355 tokens/s, CPU per step 1.368x, 1 pairs)"
    )
    # A real run (no --tiny) needs 3 pairs at least: the claim is their median.
    with pytest.raises(
        parsers.OutputError, match="1 pair\\(s\\): a claim is the median of at least 3"
    ):
        parsers.launcher_e2e(LAUNCHER_E2E_1.replace(_TINY_LINE, ""), Path("."))
    three = parsers.launcher_e2e(LAUNCHER_E2E_3.replace(_TINY_LINE, ""), Path("."))
    assert three["wall_ratio"].value == 0.198 and "3 pairs" in three["wall_ratio"].text
    # Without tokens (the CNN, the MLPs) samples per second are shown.
    samples = LAUNCHER_E2E_3.replace("| 16909 |", "| 0 |").replace("| 3355 |", "| 0 |")
    assert (
        "209.7 vs 1056.8 samples/s" in parsers.launcher_e2e(samples, Path("."))["wall_ratio"].text
    )


def test_metrics_overhead_reads_the_wall_and_cpu_medians_and_the_step_time() -> None:
    figures = parsers.metrics_overhead(METRICS_OVERHEAD, Path("."))
    assert figures["wall_ratio"].value == 0.9176 and figures["cpu_ratio"].value == 0.958
    assert figures["wall_ratio"].text == "0.9176, 33.16 ms step"


def test_checkpoint_stall_reads_the_on_thread_ratio_and_both_stalls() -> None:
    (figure,) = parsers.checkpoint_stall(CHECKPOINT_STALL, Path(".")).values()
    assert figure.value == 0.031 and figure.text == "0.031 (0.065 s vs 2.105 s)"


def test_sharded_rows_read_the_stall_percentage_and_both_steady_ratios() -> None:
    (stall,) = parsers.sharded_stall(SHARDED_STALL, Path(".")).values()
    assert stall.value == pytest.approx(0.035) and stall.text == "0.035 (201 MB per rank)"
    steady = parsers.sharded_steady(SHARDED_STEADY, Path("."))
    assert (steady["cpu_ratio"].value, steady["wall_ratio"].value) == (1.031, 1.066)


def test_restart_cost_divides_the_restart_total_by_the_in_place_total() -> None:
    figure = parsers.restart_cost(RESTART_COST, Path("."))["restart_ratio"]
    assert figure.value == pytest.approx(1.517 / 1.087) and figure.text == "1.4x (1.52 s vs 1.09 s)"


@pytest.mark.parametrize("parse, output", [
    (parsers.overhead_e2e, OVERHEAD_E2E.replace("| defaults |", "| ours |")),
    (parsers.metrics_overhead, METRICS_OVERHEAD.replace("wall on/off", "wall ratio")),
    (parsers.checkpoint_stall, CHECKPOINT_STALL.replace("| sync |", "| synchronous |")),
    (parsers.restart_cost, RESTART_COST.replace("**total**", "total")),
    (parsers.sharded_stall, SHARDED_STALL.replace("async stall / sync stall", "stall ratio")),
    (parsers.sharded_steady, SHARDED_STEADY.replace("ours / bare", "ratio")),
    (parsers.restart_cost, RESTART_COST.replace("| 1.087 |", "| 0 |")),
    (parsers.launcher_e2e, LAUNCHER_E2E_1.replace("trainer/elastic", "trainer/torchrun")),
    (parsers.launcher_e2e, LAUNCHER_E2E_1.replace("| gpt | pairs |", "| gpt | rounds |")),
    (parsers.launcher_e2e, LAUNCHER_E2E_1.split("\n\n")[0]),  # no throughput table
])  # fmt: skip
def test_a_changed_output_format_is_an_error_not_a_figure(
    parse: parsers.Parser, output: str
) -> None:
    with pytest.raises(parsers.OutputError):
        parse(output, Path("."))


def test_gpu_tests_count_per_file_what_did_not_pass_and_allow_the_two_gpu_skip(
    tmp_path: Path,
) -> None:
    (tmp_path / parsers.GPU_TESTS_XML).write_text(JUNIT)
    figures = parsers.gpu_tests("", tmp_path)
    assert figures["test_cuda_nccl"] == parsers.Figure(
        0, "1 passed, 0 failed, 1 skipped (1 needs 2 GPUs)"
    )
    # A failure and a skip for want of CUDA both count as not passed.
    assert figures["test_no_device_wait_cuda"].value == 2


def test_gpu_tests_without_their_xml_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(parsers.OutputError, match="cannot read"):
        parsers.gpu_tests("", tmp_path)


def test_targets_compare_and_never_pass_nan() -> None:
    assert Target(">=", 0.99).met(0.99) and not Target(">=", 0.99).met(0.989)
    assert Target("<=", 0.05).met(0.05) and not Target(">", 1.0).met(1.0)
    assert not Target(">=", 0.0).met(float("nan"))
    assert str(Target(">=", 0.98)) == ">= 0.98" and str(Target("==", 0, "all pass")) == "all pass"
    with pytest.raises(ValueError, match="op"):
        Target("=>", 1.0)


def test_the_plan_names_every_claims_step_and_figure_and_fits_the_budget() -> None:
    assert all(c.step is None or c.step in PLAN.by_name for c in PLAN.claims)
    assert sum(s.limit_s for s in PLAN.steps) <= PLAN.budget_s == 570
    assert all(s.dry_limit_s <= PLAN.dry_budget_s for s in PLAN.steps)  # the budget caps their sum
    assert [c.claim for c in PLAN.claims if c.step is None] == []  # every row is measured
    with pytest.raises(ValueError, match="no step named"):
        Plan(steps=(), claims=(Claim(claim="x", step="nope", figure="f", target=Target(">", 0)),), budget_s=1,
             dry_budget_s=1)  # fmt: skip


def test_the_launcher_step_claims_3_pairs_on_the_gpu_and_only_its_dry_run_is_tiny() -> None:
    step = PLAN.by_name["launcher_gpt"]
    gpu, dry = step.argv(dry_run=False, out=Path("o")), step.argv(dry_run=True, out=Path("o"))
    assert gpu[gpu.index("--pairs") + 1] == "3" and "--tiny" not in gpu and "--device" in gpu
    assert "--tiny" in dry and "--device" not in dry and step.limit_s <= 90
    assert [c.target for c in PLAN.claims if c.step == "launcher_gpt"] == [Target(">=", 0.99)]


def _claim(step: str | None = "s", target: Target | None = None) -> Claim:
    return Claim(claim="c", step=step, figure="f", target=target or Target(">=", 0.99))


@pytest.mark.parametrize("result, verdict", [
    (StepResult("s", "ok", figures={"f": parsers.Figure(0.995, "0.995")}), "pass"),
    (StepResult("s", "ok", figures={"f": parsers.Figure(0.95, "0.95")}), "fail"),
    (StepResult("s", "ok", figures={}), "error"),
    (StepResult("s", "timed out", "killed at its 60 s limit"), "error"),
    (StepResult("s", "failed", "exit 1: boom"), "error"),
    (StepResult("s", "skipped", "needs 2 GPUs, 1 visible"), "skipped"),
    (None, "not run"),
])  # fmt: skip
def test_row_verdicts(result: StepResult | None, verdict: str) -> None:
    row = report.row_of(_claim(), result)
    assert row.verdict == verdict
    assert report.failed([row], dry_run=False) == ([row] if verdict in ("fail", "error") else [])
    assert report.failed([row], dry_run=True) == ([row] if verdict == "error" else [])


def test_a_claim_not_built_yet_is_a_row_that_never_fails() -> None:
    row = report.row_of(Claim(claim="sharded", step=None), None)
    assert (row.gpu, row.verdict) == ("not built yet", "not built yet") and not report.failed(
        [row], dry_run=False
    )


def test_the_table_has_every_row_and_the_cpu_figures_sources_as_footnotes() -> None:
    claims = [Claim(claim="a", step="s", figure="f", cpu="1.1", cpu_source="session 1", target=Target(">", 1)),
              Claim(claim="b | c", step="s", figure="f", cpu="0.9", cpu_source="session 1", target=Target(">", 1)),
              Claim(claim="d", step=None)]  # fmt: skip
    rows, notes = report.rows_of(
        claims, {"s": StepResult("s", "ok", figures={"f": parsers.Figure(2, "2.0")})}
    )
    text = report.table(rows, notes, heading="H", dry_run=False)
    assert notes == ["session 1"]
    assert "| a | 1.1 [1] | 2.0 | > 1 | pass |" in text and "| b \\| c | 0.9 [1] |" in text
    assert "| d | n/a | not built yet | - | not built yet |" in text and "[1] session 1" in text


def _python_step(name: str, code: str, *, limit_s: float = 30, parse: parsers.Parser | None = None,
                 min_gpus: int = 1) -> Step:  # fmt: skip
    def figure_of(output: str, out: Path) -> parsers.Figures:
        return {"f": parsers.Figure(float(output.split()[-1]), output.split()[-1])}

    return Step(name=name, gpu=("-c", code), dry=("-c", code), limit_s=limit_s, dry_limit_s=limit_s,
                parse=parse or figure_of, min_gpus=min_gpus)  # fmt: skip


def test_a_step_is_killed_at_its_limit_with_what_it_spawned(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "print('started', flush=True)\n"
            "time.sleep(60)\n")  # fmt: skip
    plan = Plan(
        steps=(_python_step("slow", code, limit_s=2),), claims=(), budget_s=60, dry_budget_s=60
    )
    started = time.monotonic()
    results = runner.run_plan(plan, out=tmp_path, dry_run=True, gpus=0, only=(), env=os.environ)
    elapsed = time.monotonic() - started
    result = results["slow"]
    assert result.status == "timed out" and result.reason == "killed at its 2 s limit", result
    assert result.duration_s >= 2 and elapsed < 2 + 10, elapsed
    assert "started" in (tmp_path / "slow.log").read_text()
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and Path(f"/proc/{grandchild}").exists():
        time.sleep(0.1)  # killed; its parent (init, after the step's exit) reaps it
    assert (
        not Path(f"/proc/{grandchild}").exists()
        or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
    )


def test_no_step_starts_past_the_budget_and_too_few_gpus_skip_outside_a_dry_run(
    tmp_path: Path,
) -> None:
    plan = Plan(steps=(_python_step("first", "import time; time.sleep(60)", limit_s=60),
                       _python_step("second", "print(1.0)"),
                       _python_step("two_gpus", "print(1.0)", min_gpus=2)),
                claims=(), budget_s=60, dry_budget_s=60)  # fmt: skip
    results = runner.run_plan(plan, out=tmp_path, dry_run=False, gpus=1, only=(), env=os.environ,
                                 budget_s=12.5)  # fmt: skip
    assert results["first"].status == "timed out" and results["first"].limit_s <= 2.5
    assert results["second"].status == "timed out" and "budget is spent" in results["second"].reason
    assert (
        results["two_gpus"].status == "skipped"
        and results["two_gpus"].reason == "needs 2 GPUs, 1 visible"
    )
    dry = runner.run_plan(
        plan, out=tmp_path, dry_run=True, gpus=0, only=("two_gpus",), env=os.environ
    )
    assert (
        list(dry) == ["two_gpus"] and dry["two_gpus"].status == "ok"
    )  # the dry run runs every step


def test_a_failed_exit_or_an_unreadable_output_is_a_failed_step(tmp_path: Path) -> None:
    def never(output: str, out: Path) -> parsers.Figures:
        raise parsers.OutputError("no '| defaults |' row in the output")

    plan = Plan(steps=(_python_step("crash", "import sys; print('boom'); sys.exit(3)"),
                       _python_step("garbled", "print('x')", parse=never)),
                claims=(), budget_s=60, dry_budget_s=60)  # fmt: skip
    results = runner.run_plan(plan, out=tmp_path, dry_run=True, gpus=0, only=(), env=os.environ)
    assert (results["crash"].status, results["crash"].reason) == ("failed", "exit 3: boom")
    assert (results["garbled"].status, results["garbled"].reason) == (
        "failed",
        "no '| defaults |' row in the output",
    )


def test_main_writes_the_table_and_exits_1_on_a_missed_target_but_not_in_a_dry_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = Plan(steps=(_python_step("s", "print(0.5)"),),
                claims=(Claim(claim="half", step="s", figure="f", target=Target(">=", 0.99)),
                        Claim(claim="later", step=None)),
                budget_s=60, dry_budget_s=60)  # fmt: skip
    assert gpu_check.main(["--dry-run", str(tmp_path / "dry")], plan=plan) == 0
    assert "| half | n/a | 0.5 | >= 0.99 | fail |" in (tmp_path / "dry" / "table.md").read_text()
    monkeypatch.setattr(node, "missing_on_node", lambda: [])
    monkeypatch.setattr(
        node, "probe_gpus", lambda env: {"gpus": 1, "names": ["GPU"], "torch": "t", "cuda": "c"}
    )
    assert gpu_check.main([str(tmp_path / "gpu")], plan=plan) == 1
    results = json.loads((tmp_path / "gpu" / "results.json").read_text())
    assert [r["verdict"] for r in results["rows"]] == ["fail", "not built yet"]
    assert results["steps"]["s"]["figures"]["f"]["value"] == 0.5 and results["where"].startswith(
        "1 x GPU"
    )
    assert "1 row(s) failed: half (fail)" in capsys.readouterr().err


def test_on_a_machine_without_cuda_the_real_run_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check.main([str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sees no CUDA device" in err[0] and "--dry-run" in err[0], err


def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--only", "e2e_gpt,nope", str(tmp_path)])
    assert exc.value.code == 2 and "--only: no step nope" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", str(tmp_path / "file")])
    assert "is not a folder" in capsys.readouterr().err
