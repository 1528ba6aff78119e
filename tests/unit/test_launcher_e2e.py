"""``benchmarks/launcher_e2e.py`` and its user script without running a job: the launch lines on
the CPU (unchanged), on CUDA (GPT-2 small, one worker per GPU) and at ``--tiny`` sizes, the
launchers' ``python -m`` form where no console script is installed, the summary's throughput
table, and the one-line refusal of ``--device cuda`` without a GPU. Real runs: the GPU check's dry
run (tests/integration/test_gpu_check_dry_run.py) runs ``launcher_e2e --tiny`` through both
launchers.

    pytest tests/unit/test_launcher_e2e.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import launcher_e2e

pytestmark = pytest.mark.timeout(60)


def _options(argv: list[str]) -> dict[str, str]:
    job = argv[argv.index("--api") :]
    return dict(zip(job[::2], job[1::2], strict=False))


def test_the_cpu_line_is_the_recorded_one_and_cuda_runs_gpt2_small_on_every_gpu() -> None:
    cpu = launcher_e2e.command("bare/torchrun", "gpt", "o", 2)
    assert (
        cpu[cpu.index("--api") + 2 : -2] == launcher_e2e.WORKLOADS["gpt"]
    )  # as RESULTS records it
    assert "--device" not in cpu and cpu[cpu.index("--nproc-per-node") + 1] == "2"

    cuda = launcher_e2e.command("trainer/elastic", "gpt", "o", 4, device="cuda")
    options = _options(cuda)
    assert cuda[cuda.index("--nproc-per-node") + 1] == "4" and options["--device"] == "cuda"
    assert (options["--seq-len"], options["--layers"], options["--d-model"], options["--vocab"]) == (
        "1024", "12", "768", "50304",
    )  # fmt: skip
    assert options["--global-batch-size"] == "32"  # 8 sequences per GPU
    # The MLP keeps its shape on a GPU; only the device changes.
    mlp = _options(launcher_e2e.command("bare/torchrun", "mlp1024", "o", 1, device="cuda"))
    assert (
        mlp["--width"] == "1024" and mlp["--global-batch-size"] == "64" and "--seq-len" not in mlp
    )


@pytest.mark.parametrize("workload", list(launcher_e2e.WORKLOADS))
def test_tiny_shrinks_every_workload_and_passes_only_its_own_sizes(workload: str) -> None:
    options = _options(launcher_e2e.command("bare/torchrun", workload, "o", 2, tiny=True))
    assert (options["--steps"], options["--warmup"], options["--global-batch-size"]) == (
        "8",
        "3",
        "4",
    )
    assert options["--dataset-size"] == "64"
    if workload == "gpt":
        assert (options["--d-model"], options["--layers"]) == (
            "32",
            "1",
        ) and "--width" not in options
    else:
        assert (
            options["--width"] == "8" and "--seq-len" not in options and "--d-model" not in options
        )


def test_without_console_scripts_the_launchers_run_as_python_m(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python3"))
    torchrun = launcher_e2e.command("bare/torchrun", "cnn", "o", 1)
    elastic = launcher_e2e.command("trainer/elastic", "cnn", "o", 1)
    assert torchrun[:4] == [str(bin_dir / "python3"), "-m", "torch.distributed.run", "--standalone"]
    assert elastic[:4] == [str(bin_dir / "python3"), "-m", "elastic_trainer.cli", "run"]
    (bin_dir / "torchrun").write_text("")
    (bin_dir / "elastic-trainer").write_text("")
    assert launcher_e2e.command("bare/torchrun", "cnn", "o", 1)[:2] == [
        str(bin_dir / "torchrun"),
        "--standalone",
    ]
    assert launcher_e2e.command("trainer/elastic", "cnn", "o", 1)[:2] == [
        str(bin_dir / "elastic-trainer"),
        "run",
    ]
    # Either form is a launcher in the side-CPU breakdown.
    assert (
        launcher_e2e._role("python3 -m torch.distributed.run --standalone", "1", set())
        == "launcher"
    )
    assert (
        launcher_e2e._role("python3 -m elastic_trainer.cli run --nproc-per-node", "1", set())
        == "launcher"
    )


def _record(variant: str, pair: int, steps_per_s: float) -> dict[str, Any]:
    return {"variant": variant, "workload": "gpt", "pair": pair, "device": "cuda", "steps_per_s": steps_per_s,
            "samples_per_s": 8 * steps_per_s, "tokens_per_s": 8192 * steps_per_s, "cpu_ms_per_step": 10.0,
            "first_step_s": 5.0, "script_start_s": 1.0, "threads": 4, "comm_hooks": 0, "control": "-"}  # fmt: skip


def test_the_summary_gives_throughput_and_says_when_pairs_are_too_few_for_a_claim() -> None:
    variants = ("bare/torchrun", "trainer/elastic")
    results = [_record(v, pair, rate) for pair, (a, b) in enumerate([(10.0, 9.9), (10.0, 10.1), (10.0, 9.8)])
               for v, rate in zip(variants, (a, b), strict=True)]  # fmt: skip
    text = launcher_e2e.summarize(results, variants)
    assert "| gpt | trainer/elastic | 9.90 (9.80-10.10) | 0.990 |" in text
    assert "| gpt | bare/torchrun | 80.0 | 81920 |" in text
    assert "| gpt | trainer/elastic | 79.2 | 81101 |" in text
    assert "fewer than" not in text
    assert "fewer than 3 pairs: no claim" in launcher_e2e.summarize(results[:4], variants)


def test_device_cuda_without_a_gpu_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    from benchmarks import launcher_job

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exc:
        launcher_e2e.main(["--device", "cuda", "--workloads", "gpt"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err == ["launcher_e2e: --device cuda: no CUDA device is visible"]
    with pytest.raises(SystemExit) as exc:
        launcher_job.main(["--api", "bare", "--device", "cuda", "--out", "o"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err == ["launcher_job: --device cuda: no CUDA device is visible"]


def test_the_own_loop_variant_runs_the_elastic_snippet_under_elastic_trainer_run() -> None:
    line = launcher_e2e.command("elastic/elastic", "mlp1024", "o", 2)
    assert "run" in line and any("elastic" in part for part in line[: line.index("run")])
    assert _options(line)["--api"] == "elastic"
    assert line[line.index("--api") + 2 : -2] == launcher_e2e.WORKLOADS["mlp1024"]
