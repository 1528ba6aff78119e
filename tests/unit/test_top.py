"""``elastic-trainer top`` from canned metric text: URLs, frames, endpoints down, --once, main."""

from __future__ import annotations

import io
import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_trainer.metrics.progress import samples_of
from elastic_trainer.ops import scrape, top
from tests.unit.test_metrics_progress import node_text, two_ranks

pytestmark = pytest.mark.timeout(60)

NOW = 1_700_000_103.0  # 3 s after the canned last step, 103 s after its checkpoint


class Endpoints:
    """Canned answers per URL, advancing one frame per read of the first URL (a fake for unit tests)."""

    def __init__(self, frames: dict[str, list[str | None]]) -> None:
        self.frames = frames
        self.reads: dict[str, int] = {}

    def read(self, url: str, timeout_s: float) -> scrape.Scrape:
        assert 0 < timeout_s <= top.MAX_FETCH_TIMEOUT_S
        i = self.reads.get(url, 0)
        self.reads[url] = i + 1
        answers = self.frames[url]
        text = answers[min(i, len(answers) - 1)]
        if text is None:
            return scrape.Scrape(url, error="Connection refused")
        return scrape.Scrape(url, samples=samples_of(text_string_to_metric_families(text)))


A = "http://a:9400/metrics"
B = "http://b:9400/metrics"


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("node-1:9400", "http://node-1:9400/metrics"),
        ("http://10.0.0.2:9400", "http://10.0.0.2:9400/metrics"),
        ("https://h/custom", "https://h/custom"),
        ("[::1]:9400", "http://[::1]:9400/metrics"),
    ],
)
def test_normalize_url(given: str, url: str) -> None:
    assert scrape.normalize_url(given) == url


@pytest.mark.parametrize("bad", ["ftp://h:1", "http://", "h:notaport", ":9400"])
def test_bad_urls_are_one_line_errors(bad: str) -> None:
    with pytest.raises(ValueError, match="--url"):
        scrape.normalize_url(bad)


def frame(frames: dict[str, list[str | None]], **kwargs: object) -> tuple[int, str]:
    out = io.StringIO()
    clock = iter(range(0, 1000, 10))
    code = top.run_top(list(frames), once=True, stream=out, read=Endpoints(frames).read,
                       clock=lambda: float(next(clock)), wall_clock=lambda: NOW, sleep=lambda s: None,
                       **kwargs)  # type: ignore[arg-type]  # fmt: skip
    return code, out.getvalue()


def test_once_shows_progress_rates_and_the_slowest_rank() -> None:
    code, text = frame(
        {
            A: [
                node_text(node="a-1", ranks=two_ranks(100, slow_extra=0.01), restarts=1),
                node_text(node="a-1", ranks=two_ranks(150, slow_extra=0.01), restarts=1, heals=2),
            ]
        }
    )
    assert code == 0
    assert "run job" in text
    assert re.search(r"step\s+150 / 1000\s+15\.0%", text)
    assert "ETA         2m50s" in text  # (1000 - 150) / 5 steps/s
    assert "5.00 steps/s" in text
    assert "640.0 samples/s" in text and "step time p50 75.0 ms" in text
    assert "world size  2   restarts 1   heals 2" in text
    assert "last step   3.0s ago   checkpoint step 100, 1m43s ago" in text
    assert "loss        1.5" in text and "lr 0.05" in text
    assert "slowest     rank 1 on a-1: compute 30.0 ms/step, 1.20x the median" in text
    assert "endpoints   1 of 1 up" in text
    assert re.search(r"up\s+a-1\s+ranks 0,1\s+restarts 1\s+http://a:9400/metrics", text)
    assert "\x1b" not in text  # --once is plain text


def test_an_unreachable_endpoint_is_listed_and_the_rest_shown() -> None:
    code, text = frame(
        {
            A: [
                node_text(node="a-1", ranks=two_ranks(10), world=4),
                node_text(node="a-1", ranks=two_ranks(20), world=4),
            ],
            B: [None],
        }
    )
    assert code == 0
    assert "endpoints   1 of 2 up" in text
    assert "DOWN  http://b:9400/metrics: Connection refused" in text
    assert "(est.) samples/s" in text  # two of four ranks seen: scaled


def test_all_endpoints_down_exits_1() -> None:
    code, text = frame({A: [None]})
    assert code == 1
    assert "no live worker reports a step" in text and "DOWN" in text


def test_a_job_without_target_or_steps_yet() -> None:
    code, text = frame({A: ['elastic_trainer_restarts_total{run_id="job",node="a-1"} 0\n']})
    assert code == 0
    assert "step        -" in text and "ETA         -" in text and "slowest     -" in text
    code, text = frame({A: [node_text(node="a-1", ranks=two_ranks(5), target=None)]})
    assert "step        5 / ?" in text


def test_once_json() -> None:
    code, text = frame({A: [node_text(node="a-1", ranks=two_ranks(100)), node_text(node="a-1", ranks=two_ranks(150))],
                        B: [None]}, as_json=True)  # fmt: skip
    data = json.loads(text)
    assert code == 0
    assert (data["step"], data["total_steps"], data["world_size"], data["run_id"]) == (
        150,
        1000,
        2,
        "job",
    )
    assert data["eta_s"] == pytest.approx(170.0) and data["last_step_age_s"] == pytest.approx(3.0)
    assert data["endpoints"] == [{"url": A, "up": True, "error": None},
                                 {"url": B, "up": False, "error": "Connection refused"}]  # fmt: skip


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_view_redraws_in_place_until_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal: the alternate screen, each frame from the top-left corner, restored at the end."""
    out = FakeTerminal()
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt  # Ctrl-C

    endpoints = Endpoints(
        {A: [node_text(node="a-1", ranks=two_ranks(10 * i)) for i in range(1, 6)]}
    )
    code = top.run_top([A], interval_s=2.0, stream=out, stdin=io.StringIO(), read=endpoints.read,
                       wall_clock=lambda: NOW, sleep=sleep)  # fmt: skip
    text = out.getvalue()
    assert code == 0
    assert text.startswith("\x1b[?1049h") and text.endswith("\x1b[?25h\x1b[?1049l")
    assert text.count("\x1b[H") == 3 and "every 2s   q quits" in text
    assert "30 / 1000" in text  # the third frame
    assert all(0 < s <= 2.0 for s in sleeps)


def test_main_reports_mistakes_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert top.main(["--interval", "0"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "elastic-trainer top: error: --interval must be > 0 seconds, got 0"
    )
    assert top.main(["--url", "ftp://x", "--once"]) == 2
    assert "expected host:port" in capsys.readouterr().err
    assert top.main(["--json"]) == 2
    assert capsys.readouterr().err.strip() == "elastic-trainer top: error: --json needs --once"
    with pytest.raises(SystemExit) as exc:
        top.main(["--interval", "soon"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "invalid float value" in err


def _one_node() -> dict[str, list[str | None]]:
    return {
        A: [
            node_text(node="a-1", ranks=two_ranks(100)),
            node_text(node="a-1", ranks=two_ranks(150)),
        ]
    }


def test_a_stalled_step_shows_where_each_rank_is() -> None:
    """No step for 33 s at a 75 ms median: the frame asks where each rank is (issue 42)."""
    where = [
        "  rank 0 (a-1): step_control.py:300 in finish",
        "  rank 1 (a-1): no answer within 1.5 s",
    ]
    out = io.StringIO()
    clock = iter(range(0, 1000, 10))
    code = top.run_top([A], once=True, stream=out, read=Endpoints(_one_node()).read,
                       clock=lambda: float(next(clock)), wall_clock=lambda: NOW + 30,
                       sleep=lambda s: None, where=lambda: where)  # fmt: skip
    text = out.getvalue()
    assert code == 0
    assert "stalled     no step for 33s (5x the median step time is less)" in text, text
    assert text.rstrip().endswith("\n".join(where)), text
    code, text = frame(_one_node())  # 3 s: the metrics' own lag, no stall
    assert "stalled" not in text, text


def test_a_stall_without_the_jobs_etcd_says_how_to_see_more() -> None:
    out = io.StringIO()
    clock = iter(range(0, 1000, 10))
    top.run_top([A], once=True, stream=out, read=Endpoints(_one_node()).read,
                clock=lambda: float(next(clock)), wall_clock=lambda: NOW + 30, sleep=lambda s: None)  # fmt: skip
    assert "--rdzv-endpoint and --run-id show where each rank is" in out.getvalue()


def test_the_main_threads_innermost_frame_is_read_from_a_real_dump(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import faulthandler
    import threading

    from elastic_trainer.ops.debug import main_thread_frame

    release = threading.Event()
    helper = threading.Thread(target=release.wait)
    helper.start()
    try:
        with open(tmp_path / "stacks", "w") as out:
            faulthandler.dump_traceback(out, all_threads=True)
    finally:
        release.set()
        helper.join()
    text = (tmp_path / "stacks").read_text()
    assert text.count("most recent call first") >= 2  # the helper thread's block is skipped
    frame = main_thread_frame(text)
    assert frame is not None and frame.startswith("test_top.py:")
    assert frame.endswith(" in test_the_main_threads_innermost_frame_is_read_from_a_real_dump")
    assert main_thread_frame("Thread 0x1 (most recent call first):\n  <no Python frame>\n") is None
