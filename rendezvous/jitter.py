"""Random jitter for backoffs and spreads, from a generator of its own.

Invariant: nothing in this package draws from the global :mod:`random` generator. A worker
restores that generator bit for bit after a fault (``elastic_trainer.runtime.rng``); a
background thread that drew from it (an etcd retry, a lease keepalive backoff) would shift the
training job's Python random sequence by however many draws it made, and resume would no longer
be exact.
"""

from __future__ import annotations

import random

from tenacity import RetryCallState
from tenacity.wait import wait_base

_GENERATOR = random.Random()


def uniform(low: float, high: float) -> float:
    """A float in ``[low, high]``, drawn without touching the global generator."""
    return _GENERATOR.uniform(low, high)


class wait_jitter(wait_base):  # noqa: N801 - named like tenacity's own wait strategies
    """tenacity's ``wait_random(low, high)``, drawing from this module's generator."""

    def __init__(self, low: float, high: float) -> None:
        self.low = low
        self.high = high

    def __call__(self, retry_state: RetryCallState) -> float:
        return uniform(self.low, self.high)
