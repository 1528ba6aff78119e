"""A group that never formed leaves no trace: the next attempt in the same process names its group
(the prefix of its store keys) as a fresh process does, so a healed process and a newcomer meet."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import torch.distributed as dist
from torch.distributed import HashStore
from elastic_trainer.heal.group import HealableGroup

group = HealableGroup("gloo", 2.0)
try:
    group.create(rank=0, world_size=2, store=HashStore())  # the peer never comes
except Exception as exc:
    print("failed:", type(exc).__name__)
print("count after failure:", dist.distributed_c10d._world.group_count)
group.create(rank=0, world_size=1, store=HashStore())
print("name:", dist.distributed_c10d._get_default_group().group_name)
group.destroy()
"""


def test_a_group_that_never_formed_does_not_shift_the_next_group_name() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("failed:"), done.stdout
    assert "count after failure: 0" in lines and "name: 0" in lines, done.stdout
