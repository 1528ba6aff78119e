"""FSDPOptions (the Trainer's FSDP2 section) and apply_fsdp: which modules become FSDP units, the
mixed-precision policy and reshard-after-forward reach fully_shard, and bad settings are one-line
configuration errors. apply_fsdp runs in one real gloo process (fully_shard needs a group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.train.fsdp import FSDPOptions, units

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):  # type: ignore[no-untyped-def]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_star_is_one_name_segment() -> None:
    assert units(Net(), ("blocks.*",)) == ["blocks.0", "blocks.1", "blocks.2"]
    assert units(Net(), ("blocks.*.0", "head")) == [
        "blocks.0.0",
        "blocks.1.0",
        "blocks.2.0",
        "head",
    ]


def test_a_pattern_that_names_nothing_is_a_config_error() -> None:
    with pytest.raises(
        ConfigError,
        match=r"fsdp.blocks: 'layers\.\*' names no module of Net \(its modules include blocks",
    ):
        units(Net(), ("layers.*",))


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        (
            ("blocks",),
            r"^fsdp.blocks: 'blocks' is a ModuleList \(no forward of its own\): "
            r"name its entries, e.g. 'blocks\.\*'$",
        ),
        (("*",), r"^fsdp.blocks: '\*' selects 'blocks', a ModuleList .*e.g. 'blocks\.\*'$"),
    ],
)
def test_a_container_without_forward_is_a_config_error(
    blocks: tuple[str, ...], message: str
) -> None:
    """fully_shard refuses a ModuleList: a one-line setting error before anything is sharded,
    not a ValueError from torch that the runtime restarts as the user's code failing."""
    with pytest.raises(ConfigError, match=message):
        units(Net(), blocks)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"blocks": "blocks.*"}, "fsdp.blocks: must be a sequence of module names"),
        ({"blocks": ("",)}, "fsdp.blocks: must be a sequence"),
        ({"mixed_precision": "fp8"}, "fsdp.mixed_precision: must be one of no, bf16, fp16"),
        ({"reshard_after_forward": "yes"}, "fsdp.reshard_after_forward"),
    ],
)
def test_bad_options_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FSDPOptions(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fsdp": {"blocks": ("x",)}}, "^fsdp: must be an FSDPOptions, got dict$"),
        ({"zero_redundancy": True}, "^zero_redundancy: not with fsdp"),
        ({"sync_batchnorm": True}, "^sync_batchnorm: not with fsdp"),
        ({"mixed_precision": "bf16"}, "^mixed_precision: with fsdp, set fsdp.mixed_precision"),
    ],
)
def test_trainer_config_refuses_what_does_not_go_with_fsdp(
    kwargs: dict[str, object], message: str
) -> None:
    from elastic_trainer.train.config import TrainerConfig

    kwargs = {"fsdp": FSDPOptions(blocks=("blocks.*",)), **kwargs}
    with pytest.raises(ConfigError, match=message):
        TrainerConfig(global_batch_size=8, **kwargs)  # type: ignore[arg-type]


def test_blocks_given_as_a_list_become_a_tuple() -> None:
    assert FSDPOptions(blocks=["blocks.*"]).blocks == ("blocks.*",)  # type: ignore[arg-type]


def _worker(out: Path, mixed: str, reshard: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from elastic_trainer.state.sharded import is_sharded
    from elastic_trainer.train.fsdp import apply_fsdp

    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=0, world_size=1)
    model = Net()
    assert not is_sharded(model)
    apply_fsdp(
        model,
        FSDPOptions(blocks=("blocks.*",), mixed_precision=mixed, reshard_after_forward=reshard),  # type: ignore[arg-type]
        init_device_mesh("cpu", (1,)),
    )
    seen: list[str] = []
    model.blocks[1][0].register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
    output = model(torch.randn(4, 8))
    from torch.distributed.tensor import DTensor

    resharded = isinstance(model.blocks[0][0].weight, DTensor)  # between forward and backward
    output.float().sum().backward()
    from elastic_trainer.state.training_state import TrainingState
    from elastic_trainer.train.elastic import Elastic

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.step()
    elastic = Elastic(model, 64, global_batch_size=8)  # finds the optimizer; no DDP
    state = elastic.state
    payload = state.state_dict()
    saved = {k: v.detach().clone() for k, v in payload["model"].items()}  # live tensors: copy
    moved = {k: v.full_tensor().clone() for k, v in saved.items()}
    with torch.no_grad():
        model.head.weight.add_(1.0)  # changed after the payload was taken, then restored
    restored = state.load_state_dict({**payload, "model": saved})
    # A heal in place of the Trainer / Elastic(rebuild=...): the model and optimizer are built and
    # sharded again, replace the old ones in the state, and take this rank's shards back.
    local = state.sharded.local_state(state.step) if state.sharded is not None else {}
    twin = Net()
    apply_fsdp(
        twin,
        FSDPOptions(blocks=("blocks.*",), mixed_precision=mixed, reshard_after_forward=reshard),  # type: ignore[arg-type]
        init_device_mesh("cpu", (1,)),
    )
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    state.replace({"model": twin, "optimizer": twin_optimizer})
    state.load_local_state(local)
    from elastic_trainer.runtime.failures import ConfigError

    try:
        state.replace({"bogus": twin})
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    rebuild = {
        "state_owns_twin": state.sharded is not None and state.sharded.model is twin,
        "weights_back": all(
            torch.equal(a.full_tensor(), b.full_tensor())
            for a, b in zip(twin.parameters(), model.parameters(), strict=True)
        ),
        "adam_back": all(
            torch.equal(
                twin_optimizer.state[a]["exp_avg"].full_tensor(),
                optimizer.state[b]["exp_avg"].full_tensor(),
            )
            for a, b in zip(twin.parameters(), model.parameters(), strict=True)
        ),
        "refused": refused,
    }
    plain = torch.nn.Linear(2, 2)
    replicated = TrainingState(
        {"model": plain, "optimizer": torch.optim.SGD(plain.parameters(), lr=0.1)},
        env=elastic.env,
    )
    out.write_text(
        json.dumps(
            {
                "units": [name for name, m in model.named_modules() if isinstance(m, FSDPModule)],
                "sharded": is_sharded(model),
                "dtype_inside": seen[0],
                "resharded_after_forward": resharded,
                "grad_dtype": str(model.head.weight.grad.dtype),
                "routing": {
                    "sharded": state.sharded is not None,
                    "owns": sorted(state.sharded.owns) if state.sharded is not None else [],
                    "keys": sorted(payload),
                    "model_is_dtensor": all(
                        isinstance(v, DTensor) for v in payload["model"].values()
                    ),
                    "optimizer_state_keys": sorted(payload["optimizer"]["state"]),
                    "restored": restored,
                    "weight_back": torch.equal(
                        model.head.weight.full_tensor(), moved["head.weight"]
                    ),
                    "heal_in_place": state.heal_in_place,
                    "checksummed": [name for name, _ in state.checksums()],
                    "module_is_model": elastic.module is model,
                    "ddp_is_model": elastic.ddp is model,  # `elastic.ddp(x)` as in the README
                    "replicated_sharded": replicated.sharded is not None,
                    "replicated_heal_in_place": replicated.heal_in_place,
                },
                "param_dtype": str(model.head.weight.dtype),
                "rebuild": rebuild,
            }
        )
    )
    dist.destroy_process_group()


@pytest.mark.parametrize(("mixed", "reshard"), [("bf16", False), ("no", True)])
def test_apply_fsdp_shards_the_named_blocks_then_the_model(
    tmp_path: Path, mixed: str, reshard: bool
) -> None:
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.test_fsdp_options", str(out), mixed, str(int(reshard))],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["units"] == ["", "blocks.0", "blocks.1", "blocks.2"] and result["sharded"]
    assert result["dtype_inside"] == ("torch.bfloat16" if mixed == "bf16" else "torch.float32")
    assert (
        result["param_dtype"] == result["grad_dtype"] == "torch.float32"
    )  # the sharded master copy
    assert result["resharded_after_forward"] is reshard
    # The state owner recognises the sharded model once: DCP's state-dict API (DTensors keyed by
    # parameter name, every optimizer under "optimizer"), no DDP around it, no heal from a peer;
    # a replicated model keeps plain state dicts.
    routing = result["routing"]
    assert routing["sharded"] and routing["owns"] == ["model", "optimizer"]
    assert routing["keys"] == [
        "epoch",
        "model",
        "optimizer",
        "rng",
        "sampler",
        "step",
        "world_size",
    ]
    assert routing["model_is_dtensor"] and "head.weight" in routing["optimizer_state_keys"]
    assert routing["restored"] == ["model", "optimizer", "sampler"] and routing["weight_back"]
    assert not routing["heal_in_place"] and routing["checksummed"] == ["step"]
    assert routing["module_is_model"] and routing["ddp_is_model"]
    assert not routing["replicated_sharded"] and routing["replicated_heal_in_place"]
    rebuild = result["rebuild"]
    assert rebuild["state_owns_twin"] and rebuild["weights_back"] and rebuild["adam_back"]
    assert "rebuild returned ['bogus'], which are not saved" in rebuild["refused"]


def _trainer_worker(out: Path, how: str) -> None:
    """The Trainer in one gloo process: ``fsdp`` shards the plain model the factory returns
    (bf16 compute); ``own`` trains a model the factory sharded itself."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.data import TensorDataset

    from elastic_trainer.checkpoint import files as ckpt
    from elastic_trainer.checkpoint.config import CheckpointConfig
    from elastic_trainer.runtime.distributed import read_env
    from elastic_trainer.runtime.settings import WorkerSettings
    from elastic_trainer.state.sharded import is_sharded
    from elastic_trainer.train.config import TrainerConfig
    from elastic_trainer.train.fsdp import apply_fsdp
    from elastic_trainer.train.trainer import Trainer, TrainingJob

    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=0, world_size=1)
    seen: list[str] = []

    def model() -> nn.Module:
        net = Net()
        net.head.register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
        if how == "own":
            apply_fsdp(net, FSDPOptions(blocks=("blocks.*",)), init_device_mesh("cpu", (1,)))
        return net

    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    job = TrainingJob(
        model=model,
        dataset=lambda: TensorDataset(x, (x.sum(1) > 0).long()),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        loss=nn.functional.cross_entropy,
    )
    config = TrainerConfig(
        global_batch_size=8,
        micro_batch_size=4,  # two micro-batches: FSDP2's no_sync for the first
        max_steps=3,
        checkpoint=CheckpointConfig(directory=str(out) + ".ckpt", every=2),
        fsdp=FSDPOptions(blocks=("blocks.*",), mixed_precision="bf16") if how == "fsdp" else None,
    )
    env = read_env(environ={"RANK": "0", "WORLD_SIZE": "1"}, cuda_devices=0)
    trainer = Trainer(config, job, env=env, settings=WorkerSettings())
    result = trainer.fit()
    out.write_text(
        json.dumps(
            {
                "step": result.step,
                "sharded": is_sharded(trainer.model),
                "forward_dtype": seen[0],
                "checkpoints": ckpt.iter_checkpoints(str(out) + ".ckpt"),
                "format": [
                    ckpt.verify(str(out) + ".ckpt", step).manifest.sharded for step in (2, 3)
                ],
            }
        )
    )


@pytest.mark.parametrize("how", ["fsdp", "own"])
def test_the_trainer_shards_the_model_or_takes_one_sharded(tmp_path: Path, how: str) -> None:
    out = tmp_path / "trainer.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.test_fsdp_options", "trainer", str(out), how],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["step"] == 3 and result["sharded"]
    assert result["forward_dtype"] == ("torch.bfloat16" if how == "fsdp" else "torch.float32")
    assert result["checkpoints"] == [2, 3] and result["format"] == [True, True]


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        _trainer_worker(Path(sys.argv[2]), sys.argv[3])
    else:
        _worker(Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1")
