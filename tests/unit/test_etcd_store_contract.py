"""What torch's C++ ``Store`` trampoline does with a Python store, checked without etcd.

``rendezvous/etcd_store.py`` is written against torch 2.13's trampoline (``PythonStore`` in
``torch/csrc/distributed/c10d/init.cpp``): the names it dispatches to, how Python exceptions cross
it, and that a Python object only C++ holds loses its overrides. These tests pin those facts with a
small in-memory store, so that a torch upgrade that changes one of them fails here first.
"""

from __future__ import annotations

import gc
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils import store as torch_store_util

from rendezvous.etcd_store import EtcdV3Store, StoreTimeoutError

# How each public Store method reaches a Python store behind PrefixStore (torch 2.13).
DISPATCHED_AS = {
    "set": "set",
    "get": "get",
    "add": "add",
    "compare_set": "compare_set",
    "check": "check",
    "wait": "wait",
    "num_keys": "getNumKeys",
    "delete_key": "deleteKey",
    "append": "append",
    "multi_get": "multi_get",
    "multi_set": "multi_set",
    "has_extended_api": "has_extended_api",
    "clone": "clone",
}


class RecordingStore(dist.Store):
    """A dict-backed store that records the names the trampoline calls; missing keys time out."""

    def __init__(self, data: dict[str, bytes] | None = None) -> None:
        super().__init__()
        self.data = {} if data is None else data
        self.called: list[str] = []

    def _record(self, name: str) -> None:
        self.called.append(name)

    def set(self, key: str, value: bytes) -> None:
        self._record("set")
        self.data[key] = bytes(value)

    def get(self, key: str) -> bytes:
        self._record("get")
        if key not in self.data:
            raise StoreTimeoutError(f"key {key!r} was not set within 0s (timeout)")
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        self._record("add")
        self.data[key] = str(int(self.data.get(key, b"0")) + amount).encode()
        return int(self.data[key])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self._record("compare_set")
        return self.data.get(key, bytes(expected))

    def check(self, keys: list[str]) -> bool:
        self._record("check")
        return all(k in self.data for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._record("wait")
        missing = [k for k in keys if k not in self.data]
        if missing:
            raise StoreTimeoutError(f"keys {missing} were not set within 0s (timeout)")

    def num_keys(self) -> int:
        self._record("num_keys")
        return len(self.data)

    def getNumKeys(self) -> int:  # the trampoline's name
        self._record("getNumKeys")
        return len(self.data)

    def delete_key(self, key: str) -> bool:
        self._record("delete_key")
        return self.data.pop(key, None) is not None

    def deleteKey(self, key: str) -> bool:  # the trampoline's name
        self._record("deleteKey")
        return self.data.pop(key, None) is not None

    def append(self, key: str, value: bytes) -> None:
        self._record("append")
        self.data[key] = self.data.get(key, b"") + bytes(value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._record("multi_get")
        return [self.data[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._record("multi_set")
        self.data.update(zip(keys, map(bytes, values), strict=True))

    def has_extended_api(self) -> bool:
        self._record("has_extended_api")
        return True

    def clone(self) -> RecordingStore:
        self._record("clone")
        return RecordingStore(self.data)

    def list_keys(self) -> list[str]:
        self._record("list_keys")
        return list(self.data)


def _call(store: Any, method: str) -> Any:
    arguments: dict[str, tuple[Any, ...]] = {
        "set": ("k", b"v"),
        "get": ("k",),
        "add": ("n", 1),
        "compare_set": ("k", b"v", b"w"),
        "check": (["k"],),
        "wait": (["k"],),
        "delete_key": ("gone",),
        "append": ("a", b"x"),
        "multi_get": (["k"],),
        "multi_set": (["m"], [b"1"]),
    }
    return getattr(store, method)(*arguments.get(method, ()))


@pytest.mark.parametrize("method", sorted(DISPATCHED_AS))
def test_prefix_store_dispatches_each_method_by_this_name(method: str) -> None:
    store = RecordingStore({"p/k": b"v"})
    prefixed = dist.PrefixStore("p", store)
    _call(prefixed, method)
    assert store.called[:1] == [DISPATCHED_AS[method]]


@pytest.mark.parametrize("name", sorted(set(DISPATCHED_AS.values())))
def test_etcd_store_defines_every_dispatched_name(name: str) -> None:
    assert name in vars(EtcdV3Store), f"EtcdV3Store lacks {name!r}, which PrefixStore calls"


@pytest.mark.parametrize("method", ["list_keys", "queue_push", "queue_len", "queue_pop"])
def test_prefix_store_cannot_reach_these_python_methods(method: str) -> None:
    # If torch starts dispatching one of these, EtcdV3Store can support it behind wrappers too.
    store = RecordingStore()
    arguments = {
        "list_keys": (),
        "queue_push": ("q", b"1"),
        "queue_len": ("q",),
        "queue_pop": ("q", False),
    }
    with pytest.raises(NotImplementedError):
        getattr(dist.PrefixStore("p", store), method)(*arguments[method])
    assert store.called == []


def test_store_timeout_error_is_torchs_and_pythons() -> None:
    assert issubclass(StoreTimeoutError, dist.DistStoreError)
    assert issubclass(StoreTimeoutError, LookupError)


def test_store_timeout_error_crosses_prefix_store_unchanged() -> None:
    store = RecordingStore()
    prefixed = dist.PrefixStore("p", store)
    with pytest.raises(StoreTimeoutError, match="'p/missing'"):
        prefixed.get("missing")
    with pytest.raises(StoreTimeoutError):
        prefixed.wait(["missing"], timedelta(seconds=1))


def test_torch_elastic_barrier_catches_store_timeout_error() -> None:
    # The traced barrier names the missing rank only after catching DistStoreError itself.
    store = RecordingStore()  # held here: PrefixStore keeps only its C++ half
    prefixed = dist.PrefixStore("p", store)
    with pytest.raises(dist.DistStoreError, match=r"missing_ranks=\[1\]"):
        torch_store_util.barrier(prefixed, 2, "b/", barrier_timeout=1, rank=0, trace_timeout=0.1)


def test_a_python_clone_only_cpp_holds_loses_its_overrides() -> None:
    # Why EtcdV3Store keeps its clones: torch does not keep the Python half of a clone alive.
    # If this starts failing, torch does, and etcd_store._KEPT_CLONES can go.
    store = RecordingStore()
    clone = dist.PrefixStore("p", store).clone()
    gc.collect()
    with pytest.raises(RuntimeError, match="Not implemented"):
        clone.set("k", b"v")


def test_an_etcd_store_clone_only_cpp_holds_keeps_its_overrides() -> None:
    # No etcd request is made: has_extended_api answers from Python, and the C++ base's answer
    # (what a lost Python half gives) is False.
    store = EtcdV3Store(connection=None, prefix="/unit/store", timeout=timedelta(seconds=3))  # type: ignore[arg-type]
    clone = dist.PrefixStore("p", store).clone()
    del store
    gc.collect()
    assert clone.has_extended_api() is True
    assert clone.timeout == timedelta(seconds=3)
