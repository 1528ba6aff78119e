"""The own loop's state checks (train/state_audit.py): per-rank ``states`` found after the first
step (two real gloo processes), stateful variables of the loop's frame left out of ``states`` whose
state changes in training, a resume at or past ``max_steps``, and the resume line that claims
exactness only for the saved state. Each warning is one line from rank 0, never an error."""

from __future__ import annotations

import logging
import multiprocessing
import timeit
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_trainer import Elastic
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.train import state_audit
from tests.support.dist_env import cpu_env

pytestmark = pytest.mark.timeout(120)


class GenState:
    """The user's five-line wrapper that makes a generator savable."""

    def __init__(self, g: torch.Generator) -> None:
        self.g = g

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"s": self.g.get_state()}

    def load_state_dict(self, s: dict[str, torch.Tensor]) -> None:
        self.g.set_state(s["s"])


class RunningAvg:
    def __init__(self) -> None:
        self.total, self.n = 0.0, 0

    def update(self, v: float) -> None:
        self.total += v
        self.n += 1

    def state_dict(self) -> dict[str, float]:
        return {"total": self.total, "n": self.n}

    def load_state_dict(self, s: dict[str, float]) -> None:
        self.total, self.n = s["total"], int(s["n"])


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and text in r.getMessage()
    ]


def _loop(
    directory: Path | None,
    *,
    max_steps: int,
    states: dict[str, Any] | None = None,
    ignore: tuple[str, ...] = (),
    env: DistEnv | None = None,
) -> Elastic:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
    elastic = Elastic(
        model,
        len(data),
        global_batch_size=4,
        max_steps=max_steps,
        checkpoint_dir=None if directory is None else str(directory),
        checkpoint_every=2,
        states=states,
        log_every=1000,
        env=env,
        **({"ignore_states": ignore} if ignore else {}),  # the argument the checks added
    )
    tracker = (states or {}).get("tracker")
    noise = (states or {}).get("noise")
    for step in elastic:
        with step:
            for micro in step:
                x = data[list(micro.indices)]
                if noise is not None:
                    x = x + 0.01 * torch.randn(x.shape, generator=noise.g)
                loss = elastic.ddp(x).square().mean()
                step.backward(loss * step.weight)
                if tracker is not None:
                    tracker.update(loss.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return elastic


# -- (a) a resume at or past max_steps ------------------------------------------------------------
def test_a_resume_at_or_past_max_steps_warns_once_naming_the_checkpoint_and_a_fresh_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="elastic_trainer")
    _loop(tmp_path, max_steps=4)
    assert not _warnings(caplog, "nothing to train"), "a run that trained says nothing"
    caplog.clear()
    again = _loop(tmp_path, max_steps=2)  # below the checkpoint's step 4
    assert again.result is not None and again.result.exit_code == 0, "not an error"
    assert again.result.step == 4
    lines = _warnings(caplog, "nothing to train")
    assert len(lines) == 1, lines
    assert "ckpt-000000000004.pt" in lines[0] and "step 4" in lines[0], lines
    assert "max_steps=2" in lines[0] and "--checkpoint-dir" in lines[0] and "delete" in lines[0]
    caplog.clear()
    _loop(tmp_path, max_steps=4)  # a finished job re-run: the same line, still exit 0
    assert len(_warnings(caplog, "nothing to train")) == 1


# -- (d) the resume line ----------------------------------------------------------------------------
def test_the_resume_line_claims_exactness_for_the_saved_state_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="elastic_trainer")
    _loop(tmp_path, max_steps=2)
    caplog.clear()
    _loop(tmp_path, max_steps=4)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from"))
    assert "exact resume of the saved state (model, optimizer, sampler)" in line, line
    assert "not on objects outside it" in line, line


# -- (c) stateful variables of the loop's frame that are not saved --------------------------------
def test_unsaved_objects_finds_generators_and_stateful_objects_by_name() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    noise, wrapped = torch.Generator(), torch.Generator()
    wrapper = GenState(wrapped)
    namespace = {
        "model": model,
        "layer": model[0],  # part of the model
        "optimizer": optimizer,
        "loss_fn": nn.CrossEntropyLoss(),  # no parameters, no buffers
        "teacher": nn.Linear(2, 2),  # stateful, not saved
        "noise": noise,
        "wrapped": wrapped,  # held by a registered wrapper
        "wrapper": wrapper,
        "tracker": RunningAvg(),
        "RunningAvg": RunningAvg,  # a class, not an object
        "nn": nn,
        "alias": noise,
    }
    registered = [model, optimizer, wrapper]
    found = state_audit.unsaved_objects(namespace, registered, model=model)
    assert found == ["teacher", "noise", "tracker"]
    assert (
        state_audit.unsaved_objects(
            namespace, registered, model=model, ignore={"teacher", "noise", "alias", "tracker"}
        )
        == []
    )


def _user_loop_with_unsaved_state(ignore: tuple[str, ...]) -> None:
    noise = torch.Generator().manual_seed(100)  # noqa: F841 - what the check must see
    tracker = RunningAvg()  # noqa: F841
    _loop_here(ignore)


def _loop_here(ignore: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    elastic = Elastic(model, 8, global_batch_size=4, max_steps=1, ignore_states=ignore)
    for step in elastic:  # this frame is the one checked: no generator here
        with step:
            for _ in step:
                step.backward(model(torch.ones(1, 3)).sum() * step.weight)
            optimizer.step()


def test_unsaved_variables_that_change_in_training_are_named_once_in_one_short_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="elastic_trainer")
    noise = torch.Generator().manual_seed(100)
    tracker = RunningAvg()
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    elastic = Elastic(model, 32, global_batch_size=4, max_steps=6)
    for step in elastic:
        with step:
            for _ in step:
                step.backward(model(torch.ones(1, 3)).sum() * step.weight)
            optimizer.step()
            tracker.update(1.0)
            torch.randn(1, generator=noise)
    lines = _warnings(caplog, "not saved, yet changed in training")
    assert len(lines) == 1, lines  # once per job start, not once per step
    assert "training: noise (Generator), tracker (RunningAvg);" in lines[0], lines
    assert "states={'tracker': tracker}" in lines[0], lines
    assert "noise.manual_seed(torch.initial_seed() + 1)" in lines[0] and "ignore_states" in lines[0]
    assert len(lines[0]) <= 240, f"two short lines at most: {len(lines[0])} characters"

    caplog.clear()
    _user_loop_with_unsaved_state(ignore=())  # a caller's variables are not the loop's frame
    assert not _warnings(caplog, "not saved")

    caplog.clear()
    elastic = Elastic(
        model, 8, global_batch_size=4, max_steps=1, ignore_states=("noise", "tracker")
    )
    for step in elastic:
        with step:
            for _ in step:
                step.backward(model(torch.ones(1, 3)).sum() * step.weight)
            optimizer.step()
            tracker.update(1.0)
            torch.randn(1, generator=noise)
    assert not _warnings(caplog, "not saved"), "silenced by name"


def test_unsaved_variables_whose_state_training_leaves_alone_are_not_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new user's port: a generator used only to build the data before ``Elastic``, and a frozen
    teacher (forward only) have nothing a restart could lose; only the generator the loop draws
    from (dropout, augmentation) is named."""
    caplog.set_level(logging.INFO, logger="elastic_trainer")
    data_gen = torch.Generator().manual_seed(0)
    data = torch.randn(32, 3, generator=data_gen)  # the synthetic dataset, before Elastic
    teacher = nn.Linear(3, 1)
    teacher.requires_grad_(False)
    augment = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for draws in (False, True):
        caplog.clear()
        elastic = Elastic(model, len(data), global_batch_size=4, max_steps=4)
        for step in elastic:
            with step:
                for micro in step:
                    x = data[list(micro.indices)]
                    if draws:
                        x = x + 0.01 * torch.randn(x.shape, generator=augment)
                    loss = (model(x) - teacher(x)).square().mean()
                    step.backward(loss * step.weight)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        lines = _warnings(caplog, "not saved")
        if not draws:
            assert not lines, "nothing the loop changes is named"
        else:
            assert len(lines) == 1 and "augment (Generator)" in lines[0], lines
            assert "data_gen" not in lines[0] and "teacher" not in lines[0], lines


def test_the_watch_sees_a_large_state_move_without_copying_it() -> None:
    """Above 1 MiB of tensors (a teacher, an EMA of the model) the fingerprint reads each
    tensor's version counter and first elements: an optimizer step, an in-place EMA update and a
    write through ``.data`` all count as a change; a forward does not."""
    big = nn.Linear(1024, 512)  # 2 MiB of weights
    assert state_audit._tensor_bytes(big.state_dict()) > state_audit.SMALL_STATE_BYTES
    optimizer = torch.optim.SGD(big.parameters(), lr=0.1)
    frozen, ema, by_data = nn.Linear(1024, 512), nn.Linear(1024, 512), nn.Linear(1024, 512)
    objects = {"big": big, "frozen": frozen, "ema": ema, "by_data": by_data}
    watch = state_audit.UnsavedWatch(objects)
    big(torch.ones(2, 1024)).sum().backward()
    optimizer.step()
    frozen(torch.ones(2, 1024))
    with torch.no_grad():
        ema.weight.mul_(0.99).add_(big.weight, alpha=0.01)
    by_data.weight.data.mul_(0.5)
    assert list(watch.moved()) == ["big", "ema", "by_data"]
    assert watch.moved() == {}, "it answers once"


def test_the_repo_example_has_no_unsaved_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from elastic_trainer.examples import own_loop

    caplog.set_level(logging.INFO, logger="elastic_trainer")
    for extra in ([], ["--stream"]):
        code = own_loop.main(["--max-steps", "1", "--eval-every", "1000", *extra])
        assert code == 0
    assert any("training finished" in r.getMessage() for r in caplog.records), "the check ran"
    assert not _warnings(caplog, "not saved") and not _warnings(caplog, "differ between")


# -- (b) per-rank states, two real gloo processes -------------------------------------------------
def _per_rank_worker(rank: int, store_path: str, results: Any) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("elastic_trainer").addHandler(Keep())
    logging.getLogger("elastic_trainer").setLevel(logging.INFO)
    try:
        env = cpu_env(rank, 2)
        out: dict[str, Any] = {}
        states = {
            "noise": GenState(torch.Generator().manual_seed(100 + rank)),  # per rank
            "shared": GenState(torch.Generator().manual_seed(7)),  # alike
            "tracker": RunningAvg(),  # this rank's own losses
        }
        _loop(None, max_steps=3, states=states, env=env)
        out["default"] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        records.clear()
        states = {
            "noise": GenState(torch.Generator().manual_seed(100 + rank)),
            "tracker": RunningAvg(),
        }
        _loop(None, max_steps=3, states=states, env=env, ignore=("noise", "tracker"))
        out["ignored"] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        # The check's cost where it runs: checksums of the small states and one allreduce.
        objects = {"noise": states["noise"], "tracker": states["tracker"]}
        dist.barrier()
        seconds = min(
            timeit.repeat(lambda: state_audit.differing_states(objects, env), number=20, repeat=3)
        )
        out["cost_ms"] = seconds / 20 * 1000
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_per_rank_states_are_named_once_by_rank_0_after_the_first_step(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [
        context.Process(target=_per_rank_worker, args=(rank, str(tmp_path / "store"), results))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        seen = dict(results.get(timeout=100) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
    rank0 = [m for m in seen[0]["default"] if "differ between the ranks" in m]
    assert len(rank0) == 1, seen[0]["default"]
    assert "'noise', 'tracker'" in rank0[0] and "'shared'" not in rank0[0], rank0
    assert "restored on every rank" in rank0[0] and "torch.initial_seed()" in rank0[0]
    assert not [m for m in seen[1]["default"] if "differ between" in m], "rank 0 only"
    assert not [m for m in seen[0]["ignored"] if "differ between" in m], "silenced by name"
    print(f"differing_states: {seen[0]['cost_ms']:.3f} ms a call (2 gloo ranks, 2 small states)")
    assert seen[0]["cost_ms"] < 100, "negligible: once per attempt"


def test_the_trainer_says_the_same_at_a_resume_past_max_steps_and_nothing_of_its_own_frame(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.unit.test_runtime_trainer import _fit, _job

    caplog.set_level(logging.INFO, logger="elastic_trainer")
    _fit(_job(), max_steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    caplog.clear()
    _, result = _fit(_job(), max_steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    assert result.step == 4
    lines = _warnings(caplog, "nothing to train")
    assert len(lines) == 1 and "step 4" in lines[0] and "max_steps=2" in lines[0], lines
    assert not _warnings(caplog, "not saved"), "the Trainer's loop saves what it builds"


_SHARDED_LOOP = """
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from elastic_trainer import Elastic, ElasticGroup, exit_process


def build(env):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4)).to(env.device)
    fully_shard(model)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


with ElasticGroup() as group:
    first = build(group.env)
    teacher = nn.Linear(4, 4)  # an average of the model, bound to nothing saved or rebuilt
    elastic = Elastic(first["model"], 16, global_batch_size=4, max_steps=2, group=group,
                      rebuild=build)
    for step in elastic:
        optimizer = elastic.state.objects["optimizer"]
        with step:
            for micro in step:
                x = torch.ones(len(micro.indices), 4)
                step.backward(elastic.module(x).sum() * step.weight)
            optimizer.step()
            with torch.no_grad():
                teacher.weight.mul_(0.9)
exit_process(elastic.result.exit_code if elastic.result is not None else 0)
"""


def test_with_rebuild_the_unsaved_warning_says_to_build_and_return_them_there(
    tmp_path: Path,
) -> None:
    """A loop of one's own with a model sharded by hand (``rebuild=``): the objects it builds are
    built again after a heal, so the advice is to build them in ``rebuild`` and return them by
    name, not only to register them (a new user's FSDP2 port kept a scheduler outside it)."""
    import subprocess
    import sys

    plain = state_audit.unsaved_message({"teacher": nn.Linear(4, 4)})
    assert "rebuild=" not in plain and "states={'teacher': teacher}" in plain
    (tmp_path / "loop.py").write_text(_SHARDED_LOOP)
    done = subprocess.run(
        [sys.executable, "loop.py"], cwd=tmp_path, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "not saved, yet changed" in line]
    assert len(lines) == 1 and "teacher (Linear)" in lines[0], done.stderr[-2000:]
    assert "build them in your rebuild= function and return them by name" in lines[0], lines[0]


def test_the_unsaved_warning_names_scaler_for_a_grad_scaler() -> None:
    """An unsaved GradScaler is fixed by ``Elastic(scaler=)`` (which also scales the backward),
    not by ``states=`` (issue 40 item 9)."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    message = state_audit.unsaved_message({"scaler": scaler, "teacher": nn.Linear(4, 4)})
    assert "Elastic(..., scaler=scaler)" in message, message
    assert "states={'teacher': teacher}" in message and "'scaler'" not in message, message


def test_a_rate_written_from_an_own_counter_that_started_over_is_named() -> None:
    """nanoGPT's shape: ``lr = get_lr(iter_num)`` written into the optimizer, ``iter_num += 1``
    after the step. Resumed at step 500 its counter is back at 0, the warm-up's start (issue 40
    item 2); a rate that moves as a schedule does, or one a scheduler drives, is left alone."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)  # restored: step 500's rate
    rates = state_audit.hand_set_rates([model, optimizer])
    assert rates == [6e-4]
    watch = state_audit.ScheduleWatch(rates, {"iter_num": 0, "max_iters": 5000}, 500)
    optimizer.param_groups[0]["lr"] = 6e-4 * 1 / 100  # get_lr(0) with 100 warm-up iterations
    message = watch.message(
        state_audit.hand_set_rates([optimizer]), {"iter_num": 1, "max_iters": 5000}
    )
    assert message is not None
    assert message.startswith("the learning rate went from 0.0006, restored at step 500, to 6e-06")
    assert "(likely iter_num)" in message and "step.number" in message
    assert watch.message([5.99e-4], {"iter_num": 501}) is None, "a schedule's next rate"
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    assert state_audit.hand_set_rates([optimizer, scheduler]) == []
