"""``elastic-trainer debug``: ask every rank of a live job where it is, all at once, within a bound.

    elastic-trainer debug stacks  --rdzv-endpoint 127.0.0.1:2379 --run-id job-1   # every thread
    elastic-trainer debug trace   --rdzv-endpoint ... --run-id ... --out fr/      # flight recorder
    elastic-trainer debug profile --rdzv-endpoint ... --run-id ... --steps 5 --out prof/
    elastic-trainer debug dump    --rdzv-endpoint ... --run-id ... --out dump/    # all of it, to files
    elastic-trainer debug stacks  --url node-0:9400      # the job named by a node's metrics

It reads the workers' entries (``debug/<node>/<local rank>``, ``train/diagnostics.py``) from the
run's etcd, keeps the newest entry of each rank of the newest world, and asks every rank's
endpoint in parallel. A rank that does not answer within ``--timeout`` (a stopped process, a lost
host) is named as such with the job's last published progress; the command never waits longer.
Exit status 0: every rank answered; 1: some did not; 2: bad arguments, etcd unreachable, no
entries. Design: ``docs/design/diagnostics.md``; a user's page: ``docs/diagnostics.md``.
"""

from __future__ import annotations

import argparse
import re
import time
import urllib.parse
from pathlib import Path

from elastic_trainer.launch.node_metrics import JobInfo
from elastic_trainer.launch.options import UserError
from elastic_trainer.launch.progress_publisher import ProgressKeys, read_progress
from elastic_trainer.metrics.progress import format_duration
from elastic_trainer.ops.scrape import fetch, normalize_url
from elastic_trainer.ops.status import describe_progress, run_connection
from elastic_trainer.runtime.settings import DEBUG_PROFILE_HANDLER
from elastic_trainer.train.diagnostics import Rank, ask, launchers_of, live_ranks
from rendezvous import etcd_ops
from rendezvous.round_state import RunKeys

HANDLERS = {"stacks": "dump_traceback", "native": "pyspy_dump", "trace": "fr_trace_json",
            "waits": "wait_counter_values"}  # fmt: skip
"""What each request asks a worker's endpoint (torch's handlers; ``profile``: ours)."""
DEFAULT_TIMEOUT_S = 1.5
DEFAULT_PROFILE_TIMEOUT_S = 60.0


def read_ranks(
    endpoint: str, run_id: str, conf: dict[str, str]
) -> tuple[list[Rank], list[int], str, list[Rank]]:
    """The live ranks, the ranks without an entry, a line of the job's last progress, and the
    launchers of the live ranks' nodes.

    Raises:
        UserError: bad settings, etcd unreachable, or no entry at all."""
    with run_connection(endpoint, run_id, {"retry_timeout": "5", **conf}) as (settings, etcd):
        registry = etcd_ops.get_range(
            etcd,
            RunKeys.from_settings(settings).debug,
            prefix=True,
            what="the diagnostics registry",
        )
        record, _ = read_progress(etcd, ProgressKeys.from_settings(settings))
    ranks, missing = live_ranks(list(registry.kvs))
    launchers = launchers_of(list(registry.kvs), {rank.node for rank in ranks})
    if not ranks:
        raise UserError(
            f"no worker of run {run_id!r} registered a diagnostics endpoint (is it running, "
            "on the library's loop, with ELASTIC_TRAINER_DEBUG_HOST not off?)"
        )
    progress = "the job published no progress"
    # Aged as ``status`` ages it: the record's time is the publishing host's wall clock, which no
    # monotonic clock spans.
    view, _ = describe_progress(record, None, time.time())
    if view is not None and view["step"] is not None:
        age = format_duration(view["published_age_s"])
        progress = f"the job's last published step {view['step']}, {age} ago"
    return ranks, missing, progress, launchers


def main_thread_frame(stacks: str) -> str | None:
    """The innermost frame of the main thread in ``dump_traceback``'s text, as ``file.py:LINE in
    FUNCTION``: CPython lists threads newest first, so the main thread's block is the last one."""
    blocks: list[list[str]] = []
    for line in stacks.splitlines():
        if "(most recent call first)" in line:
            blocks.append([])
        elif blocks and line.strip().startswith("File "):
            blocks[-1].append(line.strip())
    if not blocks or not blocks[-1]:
        return None
    match = re.match(r'File "(.+)", line (\d+) in (.+)', blocks[-1][0])
    return f"{Path(match[1]).name}:{match[2]} in {match[3]}" if match else None


def where_ranks_are(endpoint: str, run_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """One line a rank: where its main thread is now, or that it does not answer (``top``'s
    view of a stalled step); one line saying why when the ranks cannot be found."""
    try:
        ranks, missing, _, _ = read_ranks(endpoint, run_id, {"retry_timeout": "2"})
    except UserError as exc:
        return [f"  (where the ranks are: {exc})"]
    lines = []
    for answer in ask(ranks, HANDLERS["stacks"], timeout):
        frame = (
            None if answer.body is None else main_thread_frame(answer.body.decode(errors="replace"))
        )
        lines.append(
            f"  rank {answer.rank.rank} ({answer.rank.node}): {frame or answer.error or '?'}"
        )
    return lines + [f"  rank {r}: no endpoint registered" for r in missing]


def run(args: argparse.Namespace) -> int:
    """``elastic-trainer debug``: see the module docstring."""
    ranks, missing, progress, launchers = read_ranks(
        args.rdzv_endpoint, args.run_id, dict(args.conf)
    )
    if args.what not in ("stacks", "dump") or args.native:
        launchers = []  # a launcher has no loop to profile, no collectives, and no py-spy asked
    everyone = ranks + launchers
    handler = HANDLERS.get(args.what, "")
    if args.what == "stacks" and args.native:
        handler = HANDLERS["native"]
    timeout = args.timeout
    if args.what == "profile":
        handler = f"{DEBUG_PROFILE_HANDLER}?steps={args.steps}&timeout={timeout}"
        timeout += 5.0  # the ranks bound the steps themselves; then the trace's transfer
    started = time.monotonic()
    if args.what == "dump":
        answers = {
            what: ask(everyone, HANDLERS[what], timeout) for what in ("stacks", "trace", "waits")
        }
    else:
        answers = {args.what: ask(everyone, handler, timeout)}
    took = time.monotonic() - started
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    silent: set[str] = set()
    for what, replies in answers.items():
        for answer in replies:
            if answer.body is None:
                silent.add(answer.rank.stem)
            elif out is not None:
                suffix = "txt" if what == "stacks" else "json"
                (out / f"{answer.rank.stem}.{what}.{suffix}").write_bytes(answer.body)
    also = f" and {len(launchers)} launcher(s)" if launchers else ""
    lines = [f"{len(ranks)} rank(s){also} of run {args.run_id!r} asked in {took:.2f} s"]
    for answer in next(iter(answers.values())):
        rank = answer.rank
        if answer.body is None:
            lines.append(f"{rank.title()}: {answer.error}; {progress}")
        elif out is not None or args.what != "stacks":
            target = out if out is not None else "(use --out DIR to keep it)"
            lines.append(f"{rank.title()}: {len(answer.body)} bytes -> {target}")
        else:
            body = answer.body.decode(errors="replace").rstrip()
            lines += [f"{rank.title()}:", *("    " + line for line in body.splitlines())]
    lines += [f"rank {r}: no endpoint registered for this world; {progress}" for r in missing]
    print("\n".join(lines), flush=True)
    return 1 if silent or missing else 0


def job_of_url(text: str, timeout: float) -> tuple[str, str]:
    """The etcd endpoint and run id that a node's metrics endpoint names
    (``elastic_trainer_job_info``, served by ``elastic-trainer run --metrics-port``). An etcd on
    the node's own loopback or wildcard address (the embedded one) is reached at the URL's host.

    Raises:
        UserError: not a URL, no answer, or no such metric there."""
    try:
        url = normalize_url(text)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    scrape = fetch(url, timeout)
    if scrape.samples is None:
        raise UserError(f"--url {text}: {scrape.error}")
    for sample in scrape.samples:
        endpoint, run_id = sample.labels.get("rdzv_endpoint"), sample.labels.get("run_id")
        if sample.name == JobInfo.NAME + "_info" and endpoint and run_id:
            host = urllib.parse.urlsplit(url).hostname or ""
            return _reached_from(endpoint, host), run_id
    raise UserError(
        f"--url {text}: no {JobInfo.NAME}_info there (not the metrics endpoint of an "
        "elastic-trainer run node); give --rdzv-endpoint and --run-id"
    )


def _reached_from(endpoint: str, host: str) -> str:
    """``endpoint`` (``[scheme://]host:port[,...]``) as reached by a client that reached the node
    as ``host``: a loopback or wildcard etcd host becomes ``host``, unless ``host`` is local too."""
    if _is_local(host):
        return endpoint
    parts = []
    for one in endpoint.split(","):
        scheme, _, rest = one.rpartition("://")
        name, _, port = rest.rpartition(":")
        local = _is_local(name.strip("[]"))
        parts.append(f"{scheme + '://' if scheme else ''}{host}:{port}" if local else one)
    return ",".join(parts)


def _is_local(host: str) -> bool:
    return host in ("localhost", "::1", "0.0.0.0", "::") or host.startswith("127.")


def check_arguments(args: argparse.Namespace) -> None:
    """The argument checks argparse cannot make (one line each, as :class:`UserError`); a
    ``--url`` becomes the ``--rdzv-endpoint`` and ``--run-id`` it names."""
    if args.timeout is None:
        args.timeout = DEFAULT_PROFILE_TIMEOUT_S if args.what == "profile" else DEFAULT_TIMEOUT_S
    if not 0 < args.timeout <= 3600:
        raise UserError(f"--timeout: {args.timeout:g} is not a number of seconds in (0, 3600]")
    if not 1 <= args.steps <= 1000:
        raise UserError(f"--steps: {args.steps} is not in 1..1000")
    if args.what == "dump" and not args.out:
        raise UserError("dump: --out DIR is needed (one file per rank and kind)")
    if args.url is not None:  # the cheap checks first: this one asks the node
        if args.rdzv_endpoint or args.run_id:
            raise UserError("give --url, or --rdzv-endpoint with --run-id, not both")
        args.rdzv_endpoint, args.run_id = job_of_url(args.url, DEFAULT_TIMEOUT_S * 2)
    elif not (args.rdzv_endpoint and args.run_id):
        raise UserError("the job: give --rdzv-endpoint and --run-id, or a node's metrics --url")
