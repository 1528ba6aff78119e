"""Decide each row's verdict and write the table (``table.md``) and ``results.json``.

A row's verdict: ``pass`` / ``fail`` (the GPU figure against the target); ``error`` (its step
failed, timed out, was not started for want of time, or its output lacks the figure);
``skipped`` (the node has too few GPUs for the step); ``not run`` (left out with ``--only``);
``not built yet`` (no step measures it). Only ``fail`` and ``error`` make the check fail, and in a
dry run only ``error``: tiny CPU runs say nothing about GPU targets.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.gpu_check.plan import Claim
from benchmarks.gpu_check.runner import StepResult

FAILING = ("fail", "error")


@dataclass(frozen=True, slots=True)
class Row:
    claim: str
    cpu: str
    gpu: str
    target: str
    verdict: str
    note: int | None = None
    """Footnote number of the CPU figure's source."""


def row_of(claim: Claim, result: StepResult | None, note: int | None = None) -> Row:
    """The table row of ``claim`` given its step's result (``None``: the step was not selected)."""
    target = str(claim.target) if claim.target else "-"
    if claim.step is None:
        return Row(claim.claim, claim.cpu, "not built yet", target, "not built yet", note)
    if result is None:
        return Row(claim.claim, claim.cpu, "not run (--only)", target, "not run", note)
    if result.status == "skipped":
        return Row(claim.claim, claim.cpu, f"skipped: {result.reason}", target, "skipped", note)
    figure = result.figures.get(claim.figure)
    if result.status != "ok" or figure is None or claim.target is None:
        why = (
            result.reason if result.status != "ok" else f"no figure {claim.figure!r} in the output"
        )
        return Row(claim.claim, claim.cpu, f"{result.status}: {why}", target, "error", note)
    return Row(
        claim.claim,
        claim.cpu,
        figure.text,
        target,
        "pass" if claim.target.met(figure.value) else "fail",
        note,
    )


def rows_of(claims: Sequence[Claim], results: dict[str, StepResult]) -> tuple[list[Row], list[str]]:
    """Every claim's row, in order, and the footnotes (CPU figures' sources) they point to."""
    notes: list[str] = []
    rows = []
    for claim in claims:
        note = None
        if claim.cpu_source:
            if claim.cpu_source not in notes:
                notes.append(claim.cpu_source)
            note = notes.index(claim.cpu_source) + 1
        rows.append(row_of(claim, results.get(claim.step) if claim.step else None, note))
    return rows, notes


def failed(rows: Sequence[Row], *, dry_run: bool) -> list[Row]:
    """The rows that make the check fail."""
    return [r for r in rows if r.verdict == "error" or (r.verdict == "fail" and not dry_run)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: Sequence[Row], notes: Sequence[str], *, heading: str, dry_run: bool) -> str:
    """The Markdown table with its heading line and the CPU figures' sources below it."""
    lines = [
        heading,
        "",
        "| claim | CPU figure | GPU figure | target | pass/fail |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        cpu = f"{r.cpu} [{r.note}]" if r.note else r.cpu
        lines.append(
            f"| {_cell(r.claim)} | {_cell(cpu)} | {_cell(r.gpu)} | {_cell(r.target)} | {r.verdict} |"
        )
    if dry_run:
        lines += ["", "Dry run: the GPU column holds tiny CPU runs; pass/fail is computed but only an error "
                  "(a step that failed, timed out or printed no figure) fails the check."]  # fmt: skip
    if notes:
        lines += [
            "",
            "Where the CPU figures come from (benchmarks/RESULTS.md; 2-core CPU machine, gloo):",
        ]
        lines += [f"[{i}] {n}" for i, n in enumerate(notes, start=1)]
    return "\n".join(lines) + "\n"


def write(
    out: Path,
    text: str,
    rows: Sequence[Row],
    results: dict[str, StepResult],
    header: dict[str, object],
) -> None:
    """``table.md`` and ``results.json`` (header, every row, every step's command, time and figures)."""
    (out / "table.md").write_text(text)
    document = {
        **header,
        "rows": [asdict(r) for r in rows],
        "steps": {name: {**asdict(r), "figures": {k: asdict(f) for k, f in r.figures.items()}}
                  for name, r in results.items()},
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(document, indent=2) + "\n")
