"""etcd3 imports under the current protobuf, with its fast and its pure-Python implementation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
import google.protobuf
from google.protobuf.internal import api_implementation
from rendezvous._protobuf_compat import import_etcd3
etcd3 = import_etcd3()
request = etcd3.etcdrpc.PutRequest(key=b"k", value=b"v", lease=7)
assert etcd3.etcdrpc.PutRequest.FromString(request.SerializeToString()).lease == 7
txn = etcd3.etcdrpc.TxnRequest(compare=[etcd3.etcdrpc.Compare(key=b"k", create_revision=0)])
assert txn.compare[0].target == etcd3.etcdrpc.Compare.VERSION
print(google.protobuf.__version__, api_implementation.Type())
"""


@pytest.mark.parametrize("implementation", ["default", "python"])
def test_etcd3_imports_with_current_protobuf(implementation: str) -> None:
    env = dict(os.environ)
    env.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)
    if implementation == "python":
        env["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    done = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    version, kind = done.stdout.split()
    assert int(version.split(".")[0]) >= 4  # a protobuf that the stock etcd3 stubs cannot load
    assert kind == ("python" if implementation == "python" else "upb")


def test_stock_etcd3_import_fails_without_the_shim() -> None:
    """Documents why the shim exists: if this starts passing, the shim can go."""
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    done = subprocess.run(
        [sys.executable, "-c", "import etcd3"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode != 0
    assert "Descriptors cannot be created directly" in done.stderr


def test_importing_etcd3_does_not_change_the_environment() -> None:
    code = "import os; from rendezvous._protobuf_compat import import_etcd3; import_etcd3(); print(os.environ.get('PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION'))"
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.stdout.strip() == "None", done.stderr
