"""How a launcher reports in-place heals: which epochs count, what one line says, and the root
causes a warm client leaves for it."""

from __future__ import annotations

from pathlib import Path

from elastic_trainer.heal.protocol import Epoch, Member
from elastic_trainer.launch.in_place import HealReports, describe_heal
from elastic_trainer.launch.warm_start import DEATHS_DIR, record_death, take_deaths

MEMBERS = (Member(id="a/0/10", slot="a/0"), Member(id="a/1/12", slot="a/1"))


def epoch(
    number: int, reason: str = "gloo: connection reset", *, step: int = 120, finished: bool = False
) -> Epoch:
    return Epoch(number=number, members=MEMBERS, step=step, source="a/0/10", started_unix=1.0, reason=reason,
                 finished=finished)  # fmt: skip


def test_each_heal_is_reported_once_with_the_causes_seen_since_the_last() -> None:
    calls: list[tuple[int, list[str]]] = []
    reports = HealReports(lambda e, causes: calls.append((e.number, list(causes))))
    reports.saw(epoch(1, "rendezvous"))  # torchrun's first round: not a heal
    reports.note_cause("node b lost")
    reports.saw(epoch(2))
    reports.saw(epoch(2))  # the same epoch again (a watch replay)
    reports.saw(epoch(1))  # an older one
    reports.saw(epoch(3, "join"))
    reports.saw(epoch(4, finished=True))  # the run ended
    assert calls == [(2, ["node b lost"]), (3, [])]


def test_a_failing_callback_does_not_stop_later_reports() -> None:
    seen: list[int] = []

    def on_heal(e: Epoch, _causes: object) -> None:
        seen.append(e.number)
        raise RuntimeError("etcd away")

    reports = HealReports(on_heal)
    reports.saw(epoch(2))
    reports.saw(epoch(3))
    assert seen == [2, 3]


def test_one_line_names_the_cause_and_how_the_job_went_on() -> None:
    text = describe_heal(epoch(5), ["local worker 1 (pid 42) died of SIGKILL"])
    assert text == ("local worker 1 (pid 42) died of SIGKILL; healed in place: epoch 5, 2 worker(s), "
                    "survivors at step 120")  # fmt: skip
    assert describe_heal(epoch(6, step=-1), []).startswith(
        "gloo: connection reset; healed in place: epoch 6"
    )
    assert describe_heal(epoch(6, step=-1), []).endswith("from the newest checkpoint")
    # A scale-down: this node's workers stopped with the job and restarted into the epoch.
    assert describe_heal(epoch(7, step=-1), ["node b lost"], restarted=True) == (
        "node b lost; workers restarted (they had stopped with the job): epoch 7, 2 worker(s), "
        "from the newest checkpoint"
    )


def test_deaths_are_taken_once_oldest_first(tmp_path: Path) -> None:
    (tmp_path / DEATHS_DIR).mkdir()
    record_death(tmp_path, "local worker 0 (pid 1) died of SIGKILL")
    record_death(tmp_path, "local worker 1 (pid 2) died of SIGSEGV")
    assert take_deaths(tmp_path) == [
        "local worker 0 (pid 1) died of SIGKILL",
        "local worker 1 (pid 2) died of SIGSEGV",
    ]
    assert take_deaths(tmp_path) == []
    assert take_deaths(tmp_path / "missing") == []  # no warm server directory: nothing, no error
    record_death(tmp_path / "missing", "lost")  # best effort: never raises
