"""``elastic-trainer top``: a live view of a job, read from its nodes' metrics endpoints.

    python -m elastic_trainer.ops.top                                  # this node, 127.0.0.1:9400
    python -m elastic_trainer.ops.top --url node-0:9400 --url node-1:9400 --interval 5
    python -m elastic_trainer.ops.top --once --json                    # one frame, for scripts

Every ``--interval`` seconds it reads every endpoint (in parallel, each within a timeout),
merges their samples and redraws in place with plain ANSI sequences (the terminal's alternate
screen; ``q`` or Ctrl-C quits). It shows the step and target, ETA, throughput, step time,
world size, restarts, the ages of the last step and checkpoint, loss, learning rate and the
slowest rank and node (:mod:`elastic_trainer.metrics.progress` computes all of them); when no
step ended for 5x the median step time, where each rank's main thread is (with
``--rdzv-endpoint``: :func:`elastic_trainer.ops.debug.where_ranks_are`). Rates are taken
over the frames of the last :data:`RATE_WINDOW_S` seconds; the first frame shows lifetime step
times and no rates, and ``--once`` reads twice, ``--interval`` apart, to have them. An endpoint
that cannot be read is listed as down and the others are still shown.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import select
import shutil
import signal
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any

from elastic_trainer.launch.options import UserError
from elastic_trainer.metrics.progress import (
    ProgressView,
    RateWindow,
    Sample,
    Snapshot,
    format_duration,
    progress_view,
)
from elastic_trainer.ops.scrape import Scrape, fetch, normalize_url, scrape_all
from elastic_trainer.runtime.failures import OneLineArgumentParser

PROG = "elastic-trainer top"
DEFAULT_URL = "http://127.0.0.1:9400/metrics"
DEFAULT_INTERVAL_S = 2.0
RATE_WINDOW_S = 20.0
"""Rates (steps/s, samples/s, step time, slowest rank) cover about this many seconds of frames."""
MAX_FETCH_TIMEOUT_S = 5.0
STALL_FACTOR = 5.0
"""A step is stalled once no step ended for this many median step times (issue 42)."""
STALL_MIN_S = 3.0
"""... and no less: the workers write their metrics once a second, so a healthy step can look
up to about 2 s old."""
EXAMPLES = """examples:
  elastic-trainer top                                  # this node's endpoint, 127.0.0.1:9400
  elastic-trainer top --url node-0:9400 --url node-1:9400 --interval 5
  elastic-trainer top --once --json                    # one frame for scripts

q or Ctrl-C quits."""

# Alternate screen on/off, cursor hidden/shown, cursor home, erase to line end / screen end.
_ENTER, _LEAVE, _HOME, _EOL, _EOS = (
    "\x1b[?1049h\x1b[?25l",
    "\x1b[?25h\x1b[?1049l",
    "\x1b[H",
    "\x1b[K",
    "\x1b[J",
)


class TopModel:
    """The frames' state: one rate window over the merged samples of every endpoint."""

    def __init__(self, *, run_id: str | None = None, window_s: float = RATE_WINDOW_S) -> None:
        self.run_id = run_id
        self._window = RateWindow(span_s=window_s)
        self._last_step: tuple[int, int | None] | None = (
            None  # (step, target) of the last live frame
        )

    @property
    def finished_at(self) -> int | None:
        """The step the job finished at, if the last frame with a live endpoint had reached its
        target (once every node has exited, the endpoints are gone: this is what is left)."""
        if self._last_step is None:
            return None
        step, total = self._last_step
        return step if total and step >= total else None

    def update(self, scrapes: list[Scrape], taken_at: float) -> ProgressView:
        merged: list[Sample] = []
        for scrape in scrapes:
            if scrape.samples is not None:
                merged.extend(scrape.samples)
                scrape.snapshot = Snapshot.from_samples(
                    scrape.samples, taken_at=taken_at, run_id=self.run_id
                )
        snapshot = Snapshot.from_samples(merged, taken_at=taken_at, run_id=self.run_id)
        view = progress_view(snapshot, self._window.add(snapshot))
        if view.step is not None:
            self._last_step = (view.step, view.total_steps)
        return view


def stalled_for(view: ProgressView, now_unix: float) -> float | None:
    """Seconds since the last step ended, when that is :data:`STALL_FACTOR` x the median step
    time and at least :data:`STALL_MIN_S`; else ``None`` (a job at its end is not stalled)."""
    if view.last_step_unix is None or view.step_time_p50_s is None:
        return None
    if view.step is not None and view.total_steps and view.step >= view.total_steps:
        return None
    since = now_unix - view.last_step_unix
    return since if since > max(STALL_MIN_S, STALL_FACTOR * view.step_time_p50_s) else None


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _bar(step: int, total: int, width: int = 30) -> str:
    done = min(width, max(0, round(width * step / total))) if total > 0 else 0
    return "[" + "#" * done + "." * (width - done) + "]"


def render(
    view: ProgressView,
    scrapes: list[Scrape],
    *,
    now_unix: float,
    interval_s: float | None,
    live: bool,
    finished_at: int | None = None,
) -> list[str]:
    """The lines of one frame (without terminal control sequences). ``finished_at``: no endpoint
    answers and the job had reached its target at that step (:attr:`TopModel.finished_at`)."""
    clock = datetime.fromtimestamp(now_unix).strftime("%H:%M:%S")
    run = view.run_id or (
        ", ".join(view.run_ids) + "  (several runs: pass --run-id)" if view.run_ids else "-"
    )
    head = f"elastic-trainer top   run {run}   {clock}"
    if live and interval_s is not None:
        head += f"   every {interval_s:g}s   q quits"
    return [head, "", *_job_lines(view, now_unix, finished_at), "", *_endpoint_lines(scrapes)]


def _step_line(view: ProgressView, finished_at: int | None) -> str:
    step, total = view.step, view.total_steps
    if step is None and finished_at is not None:
        return f"step        finished at step {finished_at}   (every node has exited)"
    if step is None:
        return "step        -   (no live worker reports a step)"
    if total:
        return f"step        {step} / {total}   {100.0 * step / total:5.1f}%  {_bar(step, total)}"
    return f"step        {step} / ?   (the job reports no target)"


def _job_lines(view: ProgressView, now_unix: float, finished_at: int | None) -> list[str]:
    """The job's lines: step, ETA, throughput, world, ages, loss, the slowest rank."""
    lines = [_step_line(view, finished_at)]
    lines.append(
        f"ETA         {format_duration(view.eta_s):<14}  {_num(view.steps_per_s, '.2f')} steps/s"
    )
    rate = _num(view.samples_per_s, ".1f") + (" (est.)" if view.samples_estimated else "")
    p50 = None if view.step_time_p50_s is None else view.step_time_p50_s * 1000.0
    lines.append(f"throughput  {rate} samples/s   step time p50 {_num(p50, '.1f')} ms")
    restarts, heals = view.restarts, view.heals
    lines.append(f"world size  {view.world_size if view.world_size is not None else '-'}   "
                 f"restarts {'-' if restarts is None else int(restarts)}   "
                 f"heals {'-' if heals is None else int(heals)}")  # fmt: skip
    last_step = None if view.last_step_unix is None else now_unix - view.last_step_unix
    ckpt = "none"
    if view.last_checkpoint_step is not None:
        ckpt_age = (
            None if view.last_checkpoint_unix is None else now_unix - view.last_checkpoint_unix
        )
        ckpt = f"step {view.last_checkpoint_step}, {format_duration(ckpt_age)} ago"
    lines.append(
        f"last step   {'-' if last_step is None else format_duration(last_step) + ' ago'}   checkpoint {ckpt}"
    )
    lines.append(f"loss        {_num(view.loss, '.4g'):<14}  lr {_num(view.lr, '.4g')}")
    slow = view.slowest
    if slow is None:
        lines.append("slowest     -   (needs two ranks with step times)")
    else:
        lines.append(f"slowest     rank {slow.rank} on {slow.node}: compute {slow.compute_s * 1000.0:.1f} ms/step, "
                     f"{slow.vs_median:.2f}x the median")  # fmt: skip
    return lines


def _endpoint_lines(scrapes: list[Scrape]) -> list[str]:
    """How many endpoints answer, then each one: down (why), or its nodes."""
    up = sum(1 for s in scrapes if s.error is None)
    lines = [f"endpoints   {up} of {len(scrapes)} up"]
    for scrape in scrapes:
        if scrape.error is not None:
            lines.append(f"  DOWN  {scrape.url}: {scrape.error}")
            continue
        nodes = scrape.snapshot.nodes if scrape.snapshot is not None else {}
        if not nodes:
            lines.append(f"  up    {scrape.url}: no training metrics yet")
        for name, stats in nodes.items():
            ranks = ",".join(map(str, stats.ranks)) or "none live"
            restarts_text = "-" if stats.restarts is None else str(int(stats.restarts))
            lines.append(
                f"  up    {name:<24} ranks {ranks:<12} restarts {restarts_text:<4} {scrape.url}"
            )
    return lines


def frame_json(view: ProgressView, scrapes: list[Scrape], now_unix: float) -> dict[str, Any]:
    """``--once --json``: the view plus each endpoint's state."""
    out = view.to_dict()
    out["last_step_age_s"] = (
        None if view.last_step_unix is None else round(now_unix - view.last_step_unix, 3)
    )
    out["last_checkpoint_age_s"] = (
        None
        if view.last_checkpoint_unix is None
        else round(now_unix - view.last_checkpoint_unix, 3)
    )
    out["endpoints"] = [{"url": s.url, "up": s.error is None, "error": s.error} for s in scrapes]
    return out


@contextlib.contextmanager
def _keys(stdin: IO[str] | None) -> Iterator[int | None]:
    """Single keys from a terminal on stdin (cbreak mode, restored on exit); ``None`` otherwise."""
    if stdin is None or not stdin.isatty():
        yield None
        return
    fd = stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _wait_for_quit(fd: int | None, timeout_s: float, sleep: Callable[[float], None]) -> bool:
    """Wait up to ``timeout_s``; True if ``q`` was pressed."""
    if fd is None:
        sleep(timeout_s)
        return False
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            data = os.read(fd, 64)
            if not data or b"q" in data.lower():
                return True
    return False


def run_top(
    urls: Sequence[str],
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    once: bool = False,
    stream: IO[str] | None = None,
    run_id: str | None = None,
    as_json: bool = False,
    stdin: IO[str] | None = None,
    read: Callable[[str, float], Scrape] = fetch,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    finished: Callable[[], int | None] | None = None,
    where: Callable[[], list[str]] | None = None,
) -> int:
    """Show the job behind ``urls`` until ``q`` or Ctrl-C (or one frame with ``once``).
    ``finished``: asked, once no endpoint answers, for the step the job finished at (its etcd);
    ``where``: asked, when the step stalls, for a line per rank saying where it is.

    Returns:
        The exit code: 0; with ``once``, 1 when no endpoint could be read.

    Raises:
        ValueError: a bad URL or interval.
    """
    if not interval_s > 0:
        raise ValueError(f"--interval must be > 0 seconds, got {interval_s:g}")
    if not urls:
        raise ValueError("give at least one --url")
    frames = _Frames(
        urls=[normalize_url(u) for u in urls],
        interval_s=interval_s,
        model=TopModel(run_id=run_id),
        read=read,
        clock=clock,
        wall_clock=wall_clock,
        sleep=sleep,
        finished=finished,
        where=where,
    )
    out = stream if stream is not None else sys.stdout
    if once:
        return frames.once(out, as_json=as_json)
    return frames.live(out, stdin if stdin is not None else sys.stdin)


@dataclass(kw_only=True, slots=True)
class _Frames:
    """What :func:`run_top` shows frame after frame: the endpoints, how to read them, the clocks."""

    urls: list[str]
    interval_s: float
    model: TopModel
    read: Callable[[str, float], Scrape]
    clock: Callable[[], float]
    wall_clock: Callable[[], float]
    sleep: Callable[[float], None]
    finished: Callable[[], int | None] | None
    where: Callable[[], list[str]] | None = None
    """Where each rank is now (``ops.debug.where_ranks_are``), asked when the step stalls."""

    def take(self) -> tuple[ProgressView, list[Scrape]]:
        timeout_s = min(MAX_FETCH_TIMEOUT_S, max(1.0, self.interval_s))
        scrapes = scrape_all(self.urls, timeout_s, read=self.read)
        return self.model.update(scrapes, self.clock()), scrapes

    def once(self, out: IO[str], *, as_json: bool) -> int:
        """Two reads ``interval_s`` apart (to have rates), one frame printed."""
        self.take()
        self.sleep(self.interval_s)
        view, scrapes = self.take()
        if as_json:
            out.write(json.dumps(frame_json(view, scrapes, self.wall_clock()), indent=2) + "\n")
        else:
            lines = render(view, scrapes, now_unix=self.wall_clock(), interval_s=None, live=False)
            out.write("\n".join(lines + self.stall_lines(view)) + "\n")
        out.flush()
        return 0 if any(s.error is None for s in scrapes) else 1

    def finished_at(self, scrapes: list[Scrape]) -> int | None:
        """With no endpoint answering, the step the job finished at, if that is known."""
        if any(s.error is None for s in scrapes):
            return None
        done = self.model.finished_at
        if done is None and self.finished is not None:
            done = self.finished()
        return done

    def render(self, view: ProgressView, scrapes: list[Scrape]) -> list[str]:
        """A live frame's lines."""
        lines = render(
            view,
            scrapes,
            now_unix=self.wall_clock(),
            interval_s=self.interval_s,
            live=True,
            finished_at=self.finished_at(scrapes),
        )
        return lines + self.stall_lines(view)

    def stall_lines(self, view: ProgressView) -> list[str]:
        """When no step ended for :data:`STALL_FACTOR` x the median step time (and a second):
        where each rank is, asked of the ranks' diagnostics endpoints (``--rdzv-endpoint``)."""
        stalled = stalled_for(view, self.wall_clock())
        if stalled is None:
            return []
        head = (
            f"stalled     no step for {format_duration(stalled)} ({STALL_FACTOR:g}x the median "
            "step time is less)"
        )
        if self.where is None:
            return ["", head + ": --rdzv-endpoint and --run-id show where each rank is"]
        return ["", head + "; where each rank's main thread is:", *self.where()]

    def live(self, out: IO[str], stdin: IO[str]) -> int:
        """Redraw every ``interval_s`` (in place on a terminal) until ``q`` or Ctrl-C."""
        terminal = out.isatty()
        with _keys(stdin) as fd:
            if terminal:
                out.write(_ENTER)
            try:
                while True:
                    started = self.clock()
                    view, scrapes = self.take()
                    lines = self.render(view, scrapes)
                    if terminal:
                        width = _terminal_width(out)
                        out.write(
                            _HOME + "".join(line[:width] + _EOL + "\n" for line in lines) + _EOS
                        )
                    else:
                        out.write("\n".join(lines) + "\n\n")
                    out.flush()
                    left = max(0.0, self.interval_s - (self.clock() - started))
                    if _wait_for_quit(fd, left, self.sleep):
                        return 0
            except KeyboardInterrupt:
                return 0
            finally:
                if terminal:
                    out.write(_LEAVE)
                    out.flush()


def _terminal_width(out: IO[str]) -> int:
    """The terminal's own width, read every frame (it may be resized). Not ``$COLUMNS`` first,
    as ``shutil.get_terminal_size`` does: an exported COLUMNS is often stale."""
    try:
        columns = os.get_terminal_size(out.fileno()).columns
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        columns = 0
    return columns or shutil.get_terminal_size().columns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``top``'s options (also the ``elastic-trainer top`` subcommand's)."""
    parser.add_argument("--url", action="append", default=None, metavar="URL",
                        help=f"a node's metrics endpoint, host:port or a URL; repeat for each node "
                             f"(default {DEFAULT_URL})")  # fmt: skip
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                        help=f"seconds between frames (default {DEFAULT_INTERVAL_S:g})")  # fmt: skip
    parser.add_argument(
        "--run-id", default=None, help="show only this run (when endpoints serve several)"
    )
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="with --run-id: the job's etcd, asked whether the job finished once no endpoint "
                             "answers (its nodes exit within a second of the end), and where each rank is "
                             "when a step stalls (5x the median step time)")  # fmt: skip
    parser.add_argument(
        "--once",
        action="store_true",
        help="print one frame and exit (reads twice, --interval apart)",
    )
    parser.add_argument("--json", action="store_true", help="with --once: print the frame as JSON")


def finished_step(endpoint: str, run_id: str) -> int | None:
    """The step a job that heals in place finished at, from its etcd (``None``: running, unknown,
    or etcd unreachable: top then shows what its endpoints show)."""
    from elastic_trainer.ops.status import read_status

    try:
        step = read_status(endpoint, run_id, {"retry_timeout": "2"}, None).get("finished_at_step")
    except UserError:
        return None
    return step if isinstance(step, int) else None


def where_ranks_are(endpoint: str, run_id: str) -> list[str]:
    """:func:`elastic_trainer.ops.debug.where_ranks_are` (torch and etcd: only once a step stalls)."""
    from elastic_trainer.ops import debug

    return debug.where_ranks_are(endpoint, run_id)


def run_args(args: argparse.Namespace, *, prog: str = PROG) -> int:
    """Run with parsed :func:`add_arguments` options; returns the exit code (user mistakes: one
    line on stderr, 2)."""
    if args.json and not args.once:
        print(f"{prog}: error: --json needs --once", file=sys.stderr)
        return 2
    if args.rdzv_endpoint is not None and args.run_id is None:
        print(f"{prog}: error: --rdzv-endpoint needs --run-id", file=sys.stderr)
        return 2
    finished = where = None
    if args.rdzv_endpoint is not None:
        finished = lambda: finished_step(args.rdzv_endpoint, args.run_id)  # noqa: E731
        where = lambda: where_ranks_are(args.rdzv_endpoint, args.run_id)  # noqa: E731
    # A live view quits on Ctrl-C even when it was started with SIGINT ignored (a shell's
    # background job, a harness started with nohup): the interrupt is how its user stops it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run_top(args.url or [DEFAULT_URL], interval_s=args.interval, once=args.once,
                       run_id=args.run_id, as_json=args.json, finished=finished,
                       where=where)  # fmt: skip
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    """``python -m elastic_trainer.ops.top``; returns the exit code."""
    parser = OneLineArgumentParser(prog=prog, description="Live view of a training job from its nodes' metrics endpoints.",
                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(parser)
    return run_args(parser.parse_args(argv), prog=prog)


if __name__ == "__main__":
    sys.exit(main())
