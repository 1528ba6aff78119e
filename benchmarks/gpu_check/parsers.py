"""Read the figures of each benchmark's (or the GPU tests') output.

Each parser takes the step's whole output (stdout and stderr together) and the folder it wrote
into, and returns the figures the claims compare, by name. A figure carries the number that is
checked and the text shown in the table. A parser raises :class:`OutputError` (one line) when the
output does not hold what it looks for: a benchmark that changed its format is then an error of
its row, never a silent pass. The formats are the ones ``benchmarks/RESULTS.md`` quotes.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.launcher_e2e import BASELINE, MIN_PAIRS, TINY_NOTE

# A skipped GPU test whose reason matches this is expected on a one-GPU node (the heal-in-place
# test needs two NCCL ranks on two GPUs); any other skip on a GPU node counts as not passed.
EXPECTED_SKIP = re.compile(r"needs 2 GPUs")
GPU_TESTS_XML = "gpu-tests.xml"


class OutputError(ValueError):
    """The output lacks what the parser looks for; the message says what."""


@dataclass(frozen=True, slots=True)
class Figure:
    """A measured figure: ``value`` is compared with the target, ``text`` is shown."""

    value: float
    text: str


Figures = dict[str, Figure]
Parser = Callable[[str, Path], Figures]
"""(the step's output, the output folder) -> its figures by name."""

_NUMBER = r"(-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"


def _search(pattern: str, output: str, what: str) -> re.Match[str]:
    match = re.search(pattern, output, re.MULTILINE)
    if match is None:
        raise OutputError(f"no {what} in the output")
    return match


def overhead_e2e(output: str, out_dir: Path) -> Figures:
    """``benchmarks.overhead_e2e``: the ``defaults`` row of its table (throughput and CPU per
    sample, each the median of per-block ratios against ``bare``; p99 step time)."""
    row = _search(
        rf"^\| defaults \| {_NUMBER} \| {_NUMBER} \| {_NUMBER} \| {_NUMBER} \|(?: {_NUMBER} \| {_NUMBER} \|)?",
        output, "'| defaults |' row",
    )  # fmt: skip
    wall, cpu = float(row[2]), float(row[4])
    p99 = f", step p99 {row[6]} ms" if row[6] else ""
    return {
        "wall_ratio": Figure(wall, f"{wall:.3f} ({row[1]} samples/s{p99})"),
        "cpu_ratio": Figure(cpu, f"{cpu:.3f}"),
    }


def launcher_e2e(output: str, out_dir: Path) -> Figures:
    """``benchmarks.launcher_e2e``: the ``trainer/elastic`` row of its headline table (``Trainer``
    under ``elastic-trainer run`` against bare DDP under torchrun: the medians of the per-pair
    throughput and CPU-per-step ratios), its pairs, and tokens (or samples) per second of both.
    Fewer than :data:`~benchmarks.launcher_e2e.MIN_PAIRS` pairs is an error, unless the run
    says it was ``--tiny`` (the dry run's wiring check)."""
    row = _search(
        rf"^\| (\w+) \| trainer/elastic \| {_NUMBER} \({_NUMBER}-{_NUMBER}\) \| {_NUMBER} \| {_NUMBER} \| {_NUMBER} \|",
        output, "'| trainer/elastic |' row",
    )  # fmt: skip
    workload, ratio, cpu = row[1], float(row[5]), float(row[7])
    pairs = int(_search(rf"^\| {workload} \| pairs \| (\d+) \|", output, "'| pairs |' row")[1])
    if pairs < MIN_PAIRS and TINY_NOTE not in output:
        raise OutputError(f"{pairs} pair(s): a claim is the median of at least {MIN_PAIRS}")
    rates = {  # the throughput table: samples/s and tokens/s by variant
        m[1]: (float(m[2]), float(m[3]))
        for m in re.finditer(rf"^\| {workload} \| (\S+) \| {_NUMBER} \| {_NUMBER} \|$", output, re.MULTILINE)
    }  # fmt: skip
    if "trainer/elastic" not in rates or BASELINE not in rates:
        raise OutputError(f"no samples/s of trainer/elastic and bare/torchrun for {workload}")
    (samples, tokens), (base_samples, base_tokens) = rates["trainer/elastic"], rates[BASELINE]
    rate = (
        f"{tokens:.0f} vs {base_tokens:.0f} tokens/s"
        if tokens and base_tokens
        else f"{samples:.1f} vs {base_samples:.1f} samples/s"
    )
    shown = f"{ratio:.3f} ({rate}, CPU per step {cpu:.3f}x, {pairs} pairs)"
    return {"wall_ratio": Figure(ratio, shown), "cpu_ratio": Figure(cpu, f"{cpu:.3f}")}


def metrics_overhead(output: str, out_dir: Path) -> Figures:
    """``benchmarks.metrics_overhead``: the wall (throughput) and CPU on/off ratios, median d over
    its runs."""
    wall = float(_search(rf"^wall on/off, median d: {_NUMBER}", output, "'wall on/off' line")[1])
    cpu = float(_search(rf"^CPU on/off, median d: {_NUMBER}", output, "'CPU on/off' line")[1])
    step = re.search(r"^\s*1\s+\S+\s+(\S+)", output[output.find("wall ms/step") :], re.MULTILINE)
    shown = f", {step[1]} ms step" if step else ""
    return {
        "wall_ratio": Figure(wall, f"{wall:.4f}{shown}"),
        "cpu_ratio": Figure(cpu, f"{cpu:.4f}"),
    }


def checkpoint_stall(output: str, out_dir: Path) -> Figures:
    """``benchmarks.checkpoint_stall``: the on-thread stall ratio async/sync and both medians."""
    ratio = float(
        _search(rf"^on-thread stall ratio async/sync: {_NUMBER}", output, "stall ratio line")[1]
    )
    sync = _search(rf"^\| sync \| {_NUMBER} \|", output, "'| sync |' row")[1]
    done = _search(rf"^\| async \| {_NUMBER} \|", output, "'| async |' row")[1]
    return {"stall_ratio": Figure(ratio, f"{ratio:.3f} ({done} s vs {sync} s)")}


def sharded_stall(output: str, out_dir: Path) -> Figures:
    """``benchmarks.sharded_checkpoint stall``: the async/sync on-thread stall of a sharded (DCP)
    checkpoint and the state size."""
    ratio = float(_search(rf"^async stall / sync stall: {_NUMBER} %", output, "stall line")[1])
    size = _search(rf"^state per rank: {_NUMBER} MB", output, "'state per rank' line")[1]
    return {"stall_ratio": Figure(ratio / 100.0, f"{ratio / 100.0:.3f} ({size} MB per rank)")}


def sharded_steady(output: str, out_dir: Path) -> Figures:
    """``benchmarks.sharded_checkpoint steady``: the library at its defaults against a bare FSDP2
    loop, CPU per step and throughput."""
    row = _search(
        rf"^ours / bare: CPU {_NUMBER}x \(target <= [\d.]+\), throughput {_NUMBER}",
        output, "'ours / bare' line",
    )  # fmt: skip
    cpu, wall = float(row[1]), float(row[2])
    return {"wall_ratio": Figure(wall, f"{wall:.3f}"), "cpu_ratio": Figure(cpu, f"{cpu:.3f}")}


def restart_cost(output: str, out_dir: Path) -> Figures:
    """``benchmarks.restart_cost``: total seconds of a restart against healing in place."""
    row = _search(rf"^\| \*\*total\*\* \| {_NUMBER} \| {_NUMBER} \|", output, "'| **total** |' row")
    restart, in_place = float(row[1]), float(row[2])
    if in_place <= 0:
        raise OutputError(f"in-place total {in_place} s is not positive")
    ratio = restart / in_place
    return {"restart_ratio": Figure(ratio, f"{ratio:.1f}x ({restart:.2f} s vs {in_place:.2f} s)")}


def gpu_tests(output: str, out_dir: Path) -> Figures:
    """The ``gpu``-marked tests, from pytest's JUnit XML: per test file, how many did not pass
    (failed, errored, or skipped for any reason but :data:`EXPECTED_SKIP`)."""
    path = out_dir / GPU_TESTS_XML
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError) as exc:
        raise OutputError(f"cannot read {path.name}: {exc}") from exc
    counts: dict[str, dict[str, int]] = {}
    for case in root.iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.gpu.test_x[.TestClass]
        module = next((part for part in reversed(parts) if part.startswith("test_")), parts[-1])
        tally = counts.setdefault(module, {"passed": 0, "failed": 0, "skipped": 0, "expected": 0})
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            tally["failed"] += 1
        elif skipped is not None:
            tally["skipped"] += 1
            tally["expected"] += bool(EXPECTED_SKIP.search(skipped.get("message", "")))
        else:
            tally["passed"] += 1
    figures = {}
    for module, tally in counts.items():
        bad = tally["failed"] + tally["skipped"] - tally["expected"]
        text = f"{tally['passed']} passed, {tally['failed']} failed, {tally['skipped']} skipped"
        if tally["expected"]:
            text += f" ({tally['expected']} needs 2 GPUs)"
        figures[module] = Figure(float(bad), text)
    return figures
