"""Reading nodes' ``/metrics`` endpoints, as ``top``, ``debug --url`` and the tests do: a
``host:port`` made a URL, and each endpoint's samples or the one line that says why there are none.
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from elastic_trainer.metrics.progress import Sample, Snapshot, samples_of


def normalize_url(text: str) -> str:
    """``host:port`` or a URL without a path -> ``http://host:port/metrics``.

    Raises:
        ValueError: not an http(s) URL with a host.
    """
    raw = text.strip()
    if "://" not in raw:
        raw = "http://" + raw
    parsed = urllib.parse.urlsplit(raw)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--url {text!r}: expected host:port or http(s)://host:port/metrics")
    try:
        parsed.port  # noqa: B018 -- raises on a malformed port
    except ValueError as exc:
        raise ValueError(f"--url {text!r}: {exc}") from exc
    path = parsed.path if parsed.path not in ("", "/") else "/metrics"
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, parsed.query, ""))


@dataclass(slots=True)
class Scrape:
    """One endpoint's answer: its samples, or why there are none."""

    url: str
    samples: list[Sample] | None = None
    error: str | None = None
    snapshot: Snapshot | None = field(default=None, repr=False)
    """This endpoint's values alone (its node names, ranks and restarts)."""


def fetch(url: str, timeout_s: float) -> Scrape:
    """Read and parse one endpoint; errors become :attr:`Scrape.error` (one line)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        return Scrape(url, error=f"HTTP {exc.code} {exc.reason}")
    except urllib.error.URLError as exc:
        reason = exc.reason
        return Scrape(url, error=getattr(reason, "strerror", None) or str(reason))
    except (OSError, ValueError) as exc:  # timeouts, resets, bad responses
        return Scrape(url, error=str(exc) or type(exc).__name__)
    try:
        samples = samples_of(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        return Scrape(url, error=f"not Prometheus text: {str(exc)[:80]}")
    return Scrape(url, samples=samples)


def scrape_all(
    urls: Sequence[str], timeout_s: float, *, read: Callable[[str, float], Scrape] = fetch
) -> list[Scrape]:
    """Read every endpoint in parallel (each within ``timeout_s``), in ``urls`` order."""
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(urls)))) as pool:
        return list(pool.map(lambda url: read(url, timeout_s), urls))
