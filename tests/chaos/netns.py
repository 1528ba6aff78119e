"""The chaos suite's private network (:mod:`benchmarks.netns`): fails in CI, skips elsewhere,
where ``ip netns`` is not permitted."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import pytest

from benchmarks.netns import Network
from tests.support.ci import IN_CI


@contextlib.contextmanager
def private_network(nodes: Sequence[str]) -> Iterator[Network]:
    """A :class:`benchmarks.netns.Network` of ``nodes``, closed at exit."""
    network = Network(nodes)
    try:
        network.__enter__()
    except PermissionError as exc:
        message = f"the partition scenario needs `ip netns` as root (network namespaces, veth, bridge): {exc}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield network
    finally:
        network.close()
