"""Sharded checkpoints on NCCL: the workers of tests/unit/test_sharded_checkpoint.py on GPUs
(``fully_shard`` on CUDA, NCCL for training, the checkpoint's own gloo group for DCP): saved
asynchronously from staging buffers in pinned host memory, loaded resharded at another world size
onto the GPUs, model and AdamW state identical.

Marker ``gpu``: run with ``bash scripts/test.sh tests/gpu -m gpu``; skipped without CUDA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elastic_trainer.checkpoint import files as ckpt
from tests.unit.test_sharded_checkpoint import _run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_sharded_save_on_nccl_stages_into_pinned_memory_and_reshards(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (gpu marker)")
    saving, loading = (2, 1) if torch.cuda.device_count() >= 2 else (1, 1)  # 2 -> 1 reshards
    _run("save", saving, tmp_path, device="cuda")
    assert (tmp_path / "pinned-0").read_text() == "True"
    assert ckpt.iter_checkpoints(tmp_path / "ckpt") == [4, 6]
    _run("load", loading, tmp_path, device="cuda")
    result = json.loads((tmp_path / f"loaded-{loading}-0.json").read_text())
    assert result["model"] and result["optimizer"] and result["step"] == 6
