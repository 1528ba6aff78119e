"""The c10d Store contract of EtcdV3Store against a real etcd."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from rendezvous import EtcdV3Store
from rendezvous.etcd_client import EtcdClientConfig, EtcdConnection, parse_endpoints

pytestmark = pytest.mark.integration


@pytest.fixture
def store(etcd_server, unique_id: str) -> EtcdV3Store:
    connection = EtcdConnection(EtcdClientConfig(endpoints=parse_endpoints(etcd_server.endpoint)))
    return EtcdV3Store(connection, f"/test/{unique_id}/store", timeout=timedelta(seconds=10))


def test_set_get_bytes_and_str(store: EtcdV3Store) -> None:
    store.set("k", b"\x00\xffraw")
    store.set("s", "text")
    assert store.get("k") == b"\x00\xffraw"
    assert store.get("s") == b"text"


def test_add_is_atomic_across_threads(store: EtcdV3Store) -> None:
    assert store.add("counter", 5) == 5
    threads = [threading.Thread(target=lambda: [store.add("counter", 1) for _ in range(10)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert int(store.get("counter")) == 45
    assert store.add("counter", -45) == 0


def test_compare_set_follows_tcpstore_semantics(store: EtcdV3Store) -> None:
    assert store.compare_set("cs", "", "v1") == b"v1"  # absent + empty expected -> set
    assert store.compare_set("cs", "v1", "v2") == b"v2"  # match -> set
    assert store.compare_set("cs", "nope", "v3") == b"v2"  # mismatch -> current
    assert store.compare_set("absent", "x", "y") == b"x"  # absent + expected -> expected
    assert not store.check(["absent"])


def test_check_num_keys_delete(store: EtcdV3Store) -> None:
    assert store.num_keys() == 0
    store.multi_set(["a", "b"], [b"1", "2"])
    assert store.check(["a", "b"]) and not store.check(["a", "zz"])
    assert store.num_keys() == 2
    assert store.multi_get(["b", "a"]) == [b"2", b"1"]
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == 1
    assert store.list_keys() == ["b"]


def test_append(store: EtcdV3Store) -> None:
    store.append("log", b"ab")
    store.append("log", "cd")
    assert store.get("log") == b"abcd"


def test_wait_times_out_within_its_bound(store: EtcdV3Store) -> None:
    started = time.monotonic()
    with pytest.raises(LookupError, match="not set within"):
        store.wait(["never"], timedelta(seconds=1))
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 3.0


def test_get_uses_the_store_timeout(store: EtcdV3Store) -> None:
    store.set_timeout(timedelta(seconds=1))
    started = time.monotonic()
    with pytest.raises(LookupError):
        store.get("missing")
    assert time.monotonic() - started < 3.0


def test_blocked_get_wakes_within_a_second_of_the_set(store: EtcdV3Store) -> None:
    woke: list[float] = []

    def reader() -> None:
        store.get("late")
        woke.append(time.monotonic())

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(1.5)  # the reader is blocked in a watch, not polling
    written = time.monotonic()
    store.set("late", b"now")
    thread.join(10)
    assert woke and woke[0] - written < 1.0


def test_wait_without_timeout_returns_once_all_keys_exist(store: EtcdV3Store) -> None:
    threading.Timer(0.3, lambda: store.multi_set(["w1", "w2"], [b"1", b"2"])).start()
    store.wait(["w1", "w2"])
    assert store.check(["w1", "w2"])


def test_works_under_torch_prefix_store(store: EtcdV3Store) -> None:
    prefixed = dist.PrefixStore("round.3", store)
    prefixed.set("MASTER_ADDR", "10.0.0.1")
    assert prefixed.get("MASTER_ADDR") == b"10.0.0.1"
    assert prefixed.add("n", 2) == 2
    assert prefixed.multi_get(["MASTER_ADDR"]) == [b"10.0.0.1"]
    assert store.get("round.3/MASTER_ADDR") == b"10.0.0.1"


def test_clone_shares_keys(store: EtcdV3Store) -> None:
    store.set("shared", b"1")
    assert store.clone().get("shared") == b"1"
