"""Results of ``elastic-trainer doctor``: per-rank check results, their merge, and the report.

Every rank records a :class:`CheckResult` per check in a :class:`RankReport`; :func:`merge` folds
the gathered reports into one result per check (the worst status wins, the ranks behind a WARN or
FAIL are named) and adds what only shows when ranks are compared. :func:`render_text` and
:func:`render_json` print what rank 0 shows. Pure: unit tests build reports by hand.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, SKIP, WARN, FAIL = "PASS", "SKIP", "WARN", "FAIL"
STATUSES = (PASS, SKIP, WARN, FAIL)
"""Statuses from best to worst. SKIP: the check could not run because an earlier one failed
(or it does not apply); it never hides a failure, whose own check is FAIL."""
_SEVERITY = {status: index for index, status in enumerate(STATUSES)}

CHECKS: dict[str, str] = {
    "env": "torchrun environment variables",
    "backend": "backend availability (gloo, NCCL)",
    "devices": "GPU count vs LOCAL_WORLD_SIZE",
    "timeouts": "process-group timeout and NCCL environment",
    "process_group": "process group init",
    "placement": "device placement of a test model and batch",
    "allreduce": "allreduce correctness (sum of ranks)",
    "grad_sync": "gradient synchronisation after one DDP backward",
    "bandwidth": "allreduce latency and bus bandwidth",
    "compute_comm": "compute/communication ratio of one step",
}
"""Every check, in the order it runs and is reported, with its title."""


def worst(statuses: Sequence[str]) -> str:
    """The most severe of ``statuses`` (PASS for none)."""
    return max(statuses, key=_SEVERITY.__getitem__, default=PASS)


@dataclass(kw_only=True, slots=True)
class CheckResult:
    """The outcome of one check on one rank (or merged over all ranks)."""

    name: str
    """Key in :data:`CHECKS`."""
    status: str
    """One of :data:`STATUSES`."""
    detail: str
    """One line for people: what was found, and for a WARN or FAIL what to do."""
    data: dict[str, Any] = field(default_factory=dict)
    """Measurements and values for ``--json`` (plain JSON types only)."""

    def __post_init__(self) -> None:
        if self.name not in CHECKS:
            raise ValueError(f"name: unknown check {self.name!r}")
        if self.status not in STATUSES:
            raise ValueError(f"status: must be one of {', '.join(STATUSES)}, got {self.status!r}")


@dataclass(kw_only=True, slots=True)
class RankReport:
    """What one rank found, gathered to every rank with ``all_gather_object``."""

    rank: int
    """Global rank (``-1`` when ``RANK`` was unusable)."""
    host: str
    device: str
    """Device this rank uses: ``cuda:N`` or ``cpu`` (``?`` when it could not be chosen)."""
    facts: dict[str, Any]
    """Raw values compared across ranks: the environment variables, versions."""
    results: list[CheckResult]


@dataclass(kw_only=True, slots=True)
class MergedReport:
    """The whole job's verdict, as rank 0 prints it."""

    results: list[CheckResult]
    ranks: int
    """Ranks whose results are included."""
    world_size: int
    """Ranks in the job (more than ``ranks`` in a partial report)."""
    nodes: int
    backend: str
    torch_version: str
    partial: str | None = None
    """Why only some ranks' results are shown (the others could not be gathered); ``None``: all."""
    faults: list[str] = field(default_factory=list)
    """Self-test faults injected (``ELASTIC_TRAINER_DOCTOR_FAULT``): failures are expected."""

    @property
    def status(self) -> str:
        return worst([r.status for r in self.results])

    @property
    def ok(self) -> bool:
        return self.status != FAIL


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


def _merge_one(name: str, per_rank: list[tuple[int, CheckResult]]) -> CheckResult:
    """One check's results from every rank that reported it (at least one) as one result."""
    status = worst([r.status for _, r in per_rank])
    first = per_rank[0][1]
    if status in (PASS, SKIP):
        # Details differ only in per-rank particulars (device index...): the lowest rank speaks.
        return CheckResult(name=name, status=status, detail=first.detail, data=first.data)
    by_detail: dict[str, list[int]] = defaultdict(list)
    for rank, result in per_rank:
        if result.status == status:
            by_detail[result.detail].append(rank)
    if len(per_rank) == 1:
        detail = next(iter(by_detail))  # one rank reported: naming it adds nothing
    else:
        detail = "; ".join(f"{_ranks_text(ranks)}: {text}" for text, ranks in by_detail.items())
    data = dict(first.data)
    data["ranks"] = {
        s: sorted(rank for rank, r in per_rank if r.status == s)
        for s in STATUSES
        if any(r.status == s for _, r in per_rank)
    }
    return CheckResult(name=name, status=status, detail=detail, data=data)


def _differs(var: str, values: Sequence[tuple[int, Any]]) -> str | None:
    """``var differs between ranks: ...`` when the ranks' ``values`` are not all the same."""
    seen = Counter(v for _, v in values)
    if len(seen) <= 1:
        return None
    shown = ", ".join(f"{v!r} on {_ranks_text([r for r, x in values if x == v])}" for v in seen)
    return f"{var} differs between ranks: {shown}"


def _env_ints(env: Sequence[tuple[int, Any]], var: str) -> list[tuple[int, int]]:
    """``(rank, int(value))`` of ``var`` on every rank where it is a number."""
    out = []
    for rank, values in env:
        with contextlib.suppress(TypeError, ValueError):
            out.append((rank, int(values.get(var))))
    return out


def _env_problems(env: Sequence[tuple[int, Any]]) -> list[str]:
    """What the ranks' torchrun variables say together that none says alone."""
    problems: list[str] = []
    n = len(env)
    ranks = _env_ints(env, "RANK")
    duplicated = sorted(v for v, count in Counter(v for _, v in ranks).items() if count > 1)
    if duplicated:
        problems.append(f"RANK {','.join(map(str, duplicated))} used by more than one process")
    if len(ranks) == n and not duplicated and sorted(v for _, v in ranks) != list(range(n)):
        problems.append(f"RANKs {sorted(v for _, v in ranks)} are not 0..{n - 1}")
    for var in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        problem = _differs(var, [(rank, values.get(var)) for rank, values in env])
        if problem:
            problems.append(problem)
    world = _env_ints(env, "WORLD_SIZE")
    if world and all(v == world[0][1] for _, v in world) and world[0][1] != n:
        problems.append(f"WORLD_SIZE={world[0][1]} but {n} ranks joined")
    return problems + _node_problems(env)


def _node_problems(env: Sequence[tuple[int, Any]]) -> list[str]:
    """Each node's ranks: no GROUP_RANK/LOCAL_RANK pair twice, as many as LOCAL_WORLD_SIZE says."""
    problems: list[str] = []
    groups = _env_ints(env, "GROUP_RANK")
    locals_ = dict(_env_ints(env, "LOCAL_RANK"))
    pairs = Counter((g, locals_.get(rank)) for rank, g in groups)
    clashes = sorted(
        f"{g}/{lr}" for (g, lr), count in pairs.items() if count > 1 and lr is not None
    )
    if clashes:
        problems.append(f"GROUP_RANK/LOCAL_RANK {', '.join(clashes)} used by more than one process")
    lws = dict(_env_ints(env, "LOCAL_WORLD_SIZE"))
    per_group = Counter(g for _, g in groups)
    for group, count in sorted(per_group.items()):
        declared = {lws[rank] for rank, g in groups if g == group and rank in lws}
        if len(declared) == 1 and (expected := declared.pop()) != count:
            problems.append(
                f"node GROUP_RANK={group} has {count} ranks but LOCAL_WORLD_SIZE={expected}"
            )
    return problems


def _shared_devices(reports: Sequence[RankReport]) -> list[str]:
    """Ranks on one host that use the same CUDA device."""
    cuda = [(r.rank, (r.host, r.device)) for r in reports if r.device.startswith("cuda")]
    shared = [
        (key, [rank for rank, k in cuda if k == key])
        for key, count in Counter(k for _, k in cuda).items()
        if count > 1
    ]
    return [
        f"{_ranks_text(ranks)} share {device} on {host} (device must be cuda:LOCAL_RANK)"
        for (host, device), ranks in shared
    ]


def cross_rank_findings(reports: Sequence[RankReport]) -> list[CheckResult]:
    """Problems visible only when ranks are compared; each names the check it belongs to."""
    facts = [(r.rank, r.facts) for r in reports]
    versions = [
        p
        for var, key in (("torch version", "torch_version"), ("NCCL version", "nccl_version"))
        if (p := _differs(var, [(rank, f.get(key)) for rank, f in facts]))
    ]
    timeouts = [
        p
        for var in dict.fromkeys(var for _, f in facts for var in f.get("timeouts_env", {}))
        if (p := _differs(var, [(rank, f.get("timeouts_env", {}).get(var)) for rank, f in facts]))
    ]
    found = (
        ("env", FAIL, _env_problems([(rank, f.get("env", {})) for rank, f in facts]), ""),
        ("backend", WARN, versions, ": install the same build on every node"),
        ("devices", FAIL, _shared_devices(reports), ""),
        ("timeouts", WARN, timeouts, ": set the same values on every node"),
    )
    return [
        CheckResult(name=name, status=status, detail="; ".join(problems) + advice)
        for name, status, problems, advice in found
        if problems
    ]


def merge(
    reports: Sequence[RankReport], *, partial: str | None = None, world_size: int | None = None
) -> MergedReport:
    """Fold every rank's results into one result per check (worst status wins).

    Args:
        reports: one per rank (only this rank's when the others could not be gathered).
        partial: why the report is partial, ``None`` when every rank is in it.
        world_size: ranks in the job; defaults to ``len(reports)``.
    """
    reports = sorted(reports, key=lambda r: r.rank)
    merged: list[CheckResult] = []
    findings = {f.name: f for f in cross_rank_findings(reports)} if len(reports) > 1 else {}
    for name in CHECKS:
        per_rank = [(rep.rank, res) for rep in reports for res in rep.results if res.name == name]
        if not per_rank:
            continue
        result = _merge_one(name, per_rank)
        if finding := findings.get(name):  # at most one per check
            status = worst([result.status, finding.status])
            detail = (
                finding.detail
                if result.status in (PASS, SKIP)
                else f"{result.detail}; {finding.detail}"
            )
            result = CheckResult(name=name, status=status, detail=detail, data=result.data)
        merged.append(result)
    first = reports[0].facts if reports else {}
    return MergedReport(
        results=merged,
        ranks=len(reports),
        world_size=len(reports) if world_size is None else world_size,
        nodes=len({r.host for r in reports}),
        backend=str(first.get("backend", "?")),
        torch_version=str(first.get("torch_version", "?")),
        partial=partial,
        faults=sorted({fault for r in reports for fault in r.facts.get("faults", [])}),
    )


# --- rendering -------------------------------------------------------------------------------


def format_size(size: int) -> str:
    """``1024`` -> ``1 KiB``; exact binary multiples only, else bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def bandwidth_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The nccl-tests style table: size, elements, time per allreduce, algbw, busbw."""
    lines = [f"{'size':>10} {'count':>10} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"]
    for row in rows:
        lines.append(
            f"{format_size(int(row['size_bytes'])):>10} {int(row['count']):>10} "
            f"{row['time_us']:>12.1f} {row['algbw_gbps']:>12.3f} {row['busbw_gbps']:>12.3f}"
        )
    return lines


def render_text(report: MergedReport) -> str:
    """The report people read: one line per check, the bandwidth table, the verdict."""
    if report.partial:
        who = f"{report.ranks} of {report.world_size} rank(s)"
    else:
        who = f"{report.ranks} rank(s) on {report.nodes} node(s)"
    lines = [
        f"elastic-trainer doctor: {who}, backend {report.backend}, torch {report.torch_version}"
    ]
    if report.faults:
        lines.append(
            f"SELF-TEST: faults injected on the last rank: {', '.join(report.faults)} "
            "(ELASTIC_TRAINER_DOCTOR_FAULT); their checks must FAIL"
        )
    if report.partial:
        lines.append(f"PARTIAL REPORT: {report.partial}")
    width = max(len(name) for name in CHECKS)
    for result in report.results:
        lines.append(
            f"{result.status:<4}  {result.name:<{width}}  {CHECKS[result.name]}: {result.detail}"
        )
    for result in report.results:
        rows = result.data.get("rows") if result.name == "bandwidth" else None
        if rows:
            lines.append("")
            lines.append(
                f"allreduce bus bandwidth ({report.backend}, {report.ranks} rank(s), "
                f"{result.data.get('iters')} iterations after {result.data.get('warmup')} warmup, "
                "slowest rank; busbw = algbw * 2(n-1)/n):"
            )
            lines.extend("  " + line for line in bandwidth_table(rows))
    counts = Counter(r.status for r in report.results)
    summary = ", ".join(f"{counts[s]} {s}" for s in (FAIL, WARN, SKIP, PASS) if counts[s])
    lines.append("")
    lines.append(f"RESULT: {report.status if report.status in (FAIL, WARN) else PASS} ({summary})")
    return "\n".join(lines)


def render_json(report: MergedReport) -> str:
    """The machine-readable report: the verdict, every check (with its title), the bandwidth rows."""
    document = {"ok": report.ok, "status": report.status, **asdict(report)}
    document["checks"] = [{"title": CHECKS[r["name"]], **r} for r in document.pop("results")]
    return json.dumps(document, indent=2, sort_keys=False, default=str)
