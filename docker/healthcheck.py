"""Container health check: exit 0 when the launcher's metrics endpoint answers, 1 otherwise.

Used by the image's HEALTHCHECK (Docker, compose). The launcher serves the node's Prometheus
metrics on ``--metrics-addr``/``--metrics-port`` (default ``0.0.0.0:9400``); both can also come
from ``ELASTIC_TRAINER_METRICS_ADDR`` / ``ELASTIC_TRAINER_METRICS_PORT``, which this script reads
too so the check follows the same setting. Standard library only: it runs in the image's Python.

    python docker/healthcheck.py            # checks http://127.0.0.1:9400/metrics
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

DEFAULT_PORT = 9400
TIMEOUT_S = 4.0  # below the HEALTHCHECK --timeout (5 s) so the script reports, not Docker
_WILDCARD_ADDRS = frozenset({"", "0.0.0.0", "::", "[::]"})


def metrics_url(environ: Mapping[str, str]) -> str:
    """The URL to probe: the configured address, or loopback when the launcher binds all."""
    addr = environ.get("ELASTIC_TRAINER_METRICS_ADDR", "").strip()
    host = "127.0.0.1" if addr in _WILDCARD_ADDRS else addr
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # a bare IPv6 literal
    port_text = environ.get("ELASTIC_TRAINER_METRICS_PORT", "").strip() or str(DEFAULT_PORT)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"ELASTIC_TRAINER_METRICS_PORT is not a TCP port: {port_text!r}")
    return f"http://{host}:{int(port_text)}/metrics"


def main() -> int:
    try:
        url = metrics_url(os.environ)
    except ValueError as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # noqa: S310 (http only)
            status = response.status
    except (urllib.error.URLError, OSError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url}: HTTP {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
