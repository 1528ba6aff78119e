"""torch's ``Store`` contract for EtcdV3Store against a real etcd, directly and behind PrefixStore.

The contract tests run the same assertions on torch's own ``HashStore``, so a difference in
semantics fails for exactly the implementation that differs. The tests after them cover what only
the etcd store has (errors that are both torch's and Python's, clones kept alive for C++, etcd's
transaction limit, watch-based waits) and torch's own consumers of a store: its elastic barrier and
a gloo process group, both through ``dist.PrefixStore``.
"""

from __future__ import annotations

import gc
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.utils import store as torch_store_util

from rendezvous import EtcdV3Store
from rendezvous.etcd_client import EtcdConnection
from rendezvous.etcd_store import StoreTimeoutError

pytestmark = pytest.mark.integration

TIMEOUT = timedelta(seconds=10)
SHORT = timedelta(seconds=1)


@pytest.fixture
def store(connection: EtcdConnection, unique_id: str) -> EtcdV3Store:
    return EtcdV3Store(connection, f"/test/{unique_id}/store", timeout=TIMEOUT)


@pytest.fixture
def prefixed(store: EtcdV3Store) -> dist.PrefixStore:
    """The etcd store as torch's own code meets it: behind C++, through the trampoline."""
    return dist.PrefixStore("round.3", store)


@pytest.fixture(params=["hash", "hash-prefixed", "etcd", "etcd-prefixed"])
def any_store(request: pytest.FixtureRequest) -> dist.Store:
    """torch's HashStore (the reference) and the etcd store, each directly and behind PrefixStore."""
    kind: str = request.param
    base: dist.Store
    if kind.startswith("hash"):
        base = dist.HashStore()
        base.set_timeout(TIMEOUT)
    else:
        base = request.getfixturevalue("store")  # the fixture keeps its Python half alive
    return dist.PrefixStore("p", base) if kind.endswith("-prefixed") else base


# -- the contract, the same for torch's HashStore and EtcdV3Store --------------------------------


def test_set_and_get_bytes_str_and_empty(any_store: dist.Store) -> None:
    any_store.set("k", b"\x00\xffraw")
    any_store.set("s", "text")
    any_store.set("e", b"")
    assert any_store.get("k") == b"\x00\xffraw"
    assert any_store.get("s") == b"text"
    assert any_store.get("e") == b""


def test_timeouts_raise_dist_store_error(any_store: dist.Store) -> None:
    any_store.set("present", b"1")
    any_store.set_timeout(SHORT)
    with pytest.raises(dist.DistStoreError):
        any_store.get("missing")
    with pytest.raises(dist.DistStoreError):
        any_store.wait(["present", "missing"], timedelta(milliseconds=500))
    with pytest.raises(dist.DistStoreError):
        any_store.wait(["missing"])  # no timeout given: the store's
    with pytest.raises(dist.DistStoreError):
        any_store.multi_get(["present", "missing"])


def test_wait_returns_once_every_key_is_set(any_store: dist.Store) -> None:
    writer = threading.Timer(0.3, lambda: any_store.multi_set(["w1", "w2"], [b"1", b"2"]))
    writer.start()
    try:
        any_store.wait(["w1", "w2"])
    finally:
        writer.join(10)
    assert any_store.check(["w1", "w2"])
    any_store.wait([])  # nothing to wait for


def test_add_creates_sums_and_refuses_a_non_integer(any_store: dist.Store) -> None:
    assert any_store.add("n", 5) == 5
    assert any_store.add("n", -2) == 3
    assert any_store.get("n") == b"3"
    assert any_store.add("zero", 0) == 0
    assert any_store.check(["zero"])
    any_store.set("word", b"abc")
    with pytest.raises(ValueError):
        any_store.add("word", 1)
    assert any_store.get("word") == b"abc"


def test_compare_set(any_store: dist.Store) -> None:
    assert any_store.compare_set("cs", "", "v1") == b"v1"  # missing + empty expected: set
    assert any_store.compare_set("cs", "v1", "v2") == b"v2"  # match: set
    assert any_store.compare_set("cs", "nope", "v3") == b"v2"  # mismatch: the current value
    assert any_store.compare_set("absent", "x", "y") == b"x"  # missing + expected: expected
    assert not any_store.check(["absent"])
    assert any_store.get("cs") == b"v2"


def test_append_creates_the_key_then_extends_it(any_store: dist.Store) -> None:
    any_store.append("log", b"ab")
    any_store.append("log", "cd")
    assert any_store.get("log") == b"abcd"


def test_multi_set_and_multi_get(any_store: dist.Store) -> None:
    any_store.multi_set(["a", "b"], [b"1", "2"])
    assert any_store.multi_get(["b", "a"]) == [b"2", b"1"]
    any_store.multi_set(["a"], [b"again"])
    assert any_store.multi_get(["a"]) == [b"again"]
    assert any_store.multi_get([]) == []


def test_check(any_store: dist.Store) -> None:
    any_store.set("a", b"1")
    assert any_store.check(["a"])
    assert not any_store.check(["a", "zz"])
    assert any_store.check([])


def test_num_keys_and_delete_key(any_store: dist.Store) -> None:
    assert any_store.num_keys() == 0
    any_store.multi_set(["a", "b"], [b"1", b"2"])
    assert any_store.num_keys() == 2
    assert any_store.delete_key("a") is True
    assert any_store.delete_key("a") is False
    assert any_store.num_keys() == 1
    assert not any_store.check(["a"])


def test_has_extended_api(any_store: dist.Store) -> None:
    assert any_store.has_extended_api() is True


def test_a_clone_shares_the_keys_and_the_timeout(any_store: dist.Store) -> None:
    clone = any_store.clone()
    gc.collect()
    clone.set("from-clone", b"1")
    any_store.set("from-original", b"2")
    assert any_store.get("from-clone") == b"1"
    assert clone.get("from-original") == b"2"
    assert clone.timeout == any_store.timeout  # type: ignore[attr-defined]
    assert clone.clone().get("from-clone") == b"1"


# -- what only the etcd store has ---------------------------------------------------------------


@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "prefixed"])
def test_a_timeout_is_a_store_timeout_error_after_its_bound(
    store: EtcdV3Store, prefixed: dist.PrefixStore, wrapped: bool
) -> None:
    target: dist.Store = prefixed if wrapped else store
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="not set within") as caught:
        target.wait(["never"], SHORT)
    elapsed = time.monotonic() - started
    assert isinstance(caught.value, dist.DistStoreError)
    assert isinstance(caught.value, LookupError)
    assert SHORT.total_seconds() <= elapsed < SHORT.total_seconds() + 5  # bounded, not a hang


def test_torch_elastic_barrier_catches_the_timeout(prefixed: dist.PrefixStore) -> None:
    # The traced barrier reports missing ranks only if its ``except DistStoreError`` caught ours.
    with pytest.raises(dist.DistStoreError, match=r"missing_ranks=\[1\]"):
        torch_store_util.barrier(
            prefixed, world_size=2, key_prefix="b/", barrier_timeout=1, rank=0, trace_timeout=0.1
        )


def test_gloo_process_group_over_the_prefixed_store(store: EtcdV3Store) -> None:
    results: dict[int, float] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, 2, TIMEOUT)
            value = torch.tensor([rank + 1.0])
            group.allreduce([value]).wait()
            results[rank] = value.item()
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    ranks = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(60)
    assert not errors
    assert results == {0: 3.0, 1: 3.0}


def test_gloo_process_group_with_a_missing_rank_gets_the_store_timeout(store: EtcdV3Store) -> None:
    with pytest.raises(dist.DistStoreError, match="not set within"):
        dist.ProcessGroupGloo(dist.PrefixStore("alone", store), 0, 2, SHORT)


def test_num_keys_and_delete_key_through_prefix_store(
    store: EtcdV3Store, prefixed: dist.PrefixStore
) -> None:
    prefixed.set("MASTER_ADDR", "10.0.0.1")
    prefixed.add("counter", 1)  # its retry marker lives outside the store's keys
    assert prefixed.num_keys() == store.num_keys() == 2
    assert store.get("round.3/MASTER_ADDR") == b"10.0.0.1"
    assert prefixed.delete_key("MASTER_ADDR") is True
    assert prefixed.delete_key("MASTER_ADDR") is False
    assert store.list_keys() == ["round.3/counter"]


def test_num_keys_counts_only_this_store(
    connection: EtcdConnection, store: EtcdV3Store, unique_id: str
) -> None:
    sibling = EtcdV3Store(connection, f"/test/{unique_id}/store2", timeout=TIMEOUT)
    sibling.set("other", b"1")
    store.set("mine", b"1")
    assert store.num_keys() == 1
    assert store.list_keys() == ["mine"]


def test_a_clone_made_through_prefix_store_outlives_the_wrapper(
    store: EtcdV3Store, prefixed: dist.PrefixStore
) -> None:
    clone = prefixed.clone()
    del prefixed
    gc.collect()  # only C++ holds the cloned EtcdV3Store now
    clone.set("k", b"v")
    assert clone.get("k") == b"v"
    assert clone.num_keys() == 1
    assert clone.has_extended_api() is True
    assert store.get("round.3/k") == b"v"


def test_a_clone_has_its_own_timeout(store: EtcdV3Store) -> None:
    clone = store.clone()
    assert isinstance(clone, EtcdV3Store) and clone is not store
    clone.set_timeout(SHORT)
    assert store.timeout == TIMEOUT  # type: ignore[attr-defined]
    with pytest.raises(StoreTimeoutError):
        clone.get("missing")


def test_more_keys_than_one_etcd_transaction_allows(store: EtcdV3Store) -> None:
    keys = [f"k{i}" for i in range(300)]  # etcd refuses more than 128 operations per transaction
    store.multi_set(keys, [str(i) for i in range(300)])
    assert store.num_keys() == 300
    assert store.check(keys)
    assert not store.check([*keys, "missing"])
    assert store.multi_get(keys[::-1])[:2] == [b"299", b"298"]


def test_multi_set_refuses_mismatched_lengths_and_writes_nothing(store: EtcdV3Store) -> None:
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["a", "b"], [b"1"])
    assert store.num_keys() == 0


def test_add_is_atomic_across_threads(store: EtcdV3Store) -> None:
    assert store.add("counter", 5) == 5
    threads = [
        threading.Thread(target=lambda: [store.add("counter", 1) for _ in range(10)])
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert int(store.get("counter")) == 45
    assert store.add("counter", -45) == 0


def test_blocked_get_is_woken_by_the_watch(store: EtcdV3Store) -> None:
    woke: list[float] = []

    def reader() -> None:
        store.get("late")
        woke.append(time.monotonic())

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(1.5)  # the reader is blocked in a watch
    written = time.monotonic()
    store.set("late", b"now")
    thread.join(10)
    # Without the watch the reader would wake at its 5 s safety re-read, 3.5 s after the write.
    assert woke and woke[0] - written < 2.5


def test_cancel_ends_every_wait_at_once_through_prefix_stores_and_clones(
    store: EtcdV3Store, prefixed: dist.PrefixStore
) -> None:
    """A healing process abandons a group whose member died before writing its address: cancel()
    ends a wait blocked behind C++ (PrefixStore) and in a clone, and later reads fail too."""
    clone = store.clone()
    errors: list[BaseException] = []

    def blocked(target: dist.Store, key: str) -> None:
        try:
            target.get(key)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    threads = [threading.Thread(target=blocked, args=(prefixed, "addr/1")),
               threading.Thread(target=blocked, args=(clone, "addr/2"))]  # fmt: skip
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    assert not errors and all(t.is_alive() for t in threads), "both wait for keys nobody writes"
    started = time.monotonic()
    store.cancel()
    for thread in threads:
        thread.join(5)
    assert time.monotonic() - started < 3, "cancel ended the waits at once, not at the 10 s timeout"
    assert len(errors) == 2 and all(isinstance(e, dist.DistStoreError) for e in errors), errors
    assert any("cancelled" in str(e) for e in errors), errors
    with pytest.raises(dist.DistStoreError):
        store.get("addr/3")
