"""Which of the configured etcd endpoints is the raft leader, as the members themselves say.

:class:`EtcdConnection` sends its requests (writes, linearizable reads, lease grants) to the
leader and keeps its streams (watches, keep-alives) on its home member. A request a follower
received is forwarded to the leader; if the leader dies then, the request is lost without a word
and only its deadline tells. A request sent to the leader itself fails at once when the leader's
process dies (its sockets close), and the retry asks again who leads.

Invariants:

* A belief names the member the home member reported as leader, mapped to a configured endpoint by
  the member ids that endpoints report in their own ``Status``; an unknown leader (an endpoint
  behind a load balancer, a member not in the list) maps to ``None``: requests go to the home.
* A belief is dropped by the attempt that failed on it (one rediscovery per failure wave, not per
  thread), by any response from a later raft term than the belief's (an election happened since:
  e.g. the leader died while this process sent nothing and came back as a follower), and is
  asked again after :data:`BELIEF_S` in any case.
* No leader known (:class:`LeaderUnknownError`: an election, or a lookup that failed while this
  thread waited for it) is a transient fault: the caller backs off and does not leave its home
  member. A home member without a leader (cut off) is not trusted alone: the other endpoints are
  asked, and the leader that the one with the latest raft term names is taken.
* One lookup at a time per route, with a short deadline; threads that waited for a lookup that
  failed fail at once (one lookup per failure wave, not one per thread in a row).

Why, and what it costs: ``docs/design/rendezvous-scale.md`` (Faults).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rendezvous._protobuf_compat import import_etcd3

log = logging.getLogger(__name__)

BELIEF_S = 30.0
"""A belief older than this is checked again (one ``Status`` of the home member) before use."""

PROBE_TIMEOUT_S = 1.0
"""Deadline of the ``Status`` that asks another endpoint for its member id and leader."""

LOOKUP_TIMEOUT_S = 2.0
"""Deadline of the ``Status`` that asks the home member who leads (at most the read timeout)."""


class LeaderUnknownError(RuntimeError):
    """No leader is known right now: retry after a backoff, from the same home member."""


class NoLeaderError(LeaderUnknownError):
    """No member asked knows a leader (an election is under way)."""


@dataclass(frozen=True, slots=True)
class MemberStatus:
    """What a member's ``Status`` says about itself and its leader (``leader_id`` 0: none)."""

    member_id: int
    leader_id: int
    raft_term: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class LeaderBelief:
    """Where requests go now: ``index`` of the leader's endpoint (``None``: the home member)."""

    index: int | None
    leader_id: int
    since: float
    raft_term: int = 0


def member_status(client: Any, timeout: float) -> MemberStatus:
    """One ``Status`` request, answered by the member itself (no raft round).

    Raises:
        grpc.RpcError: the member did not answer.
    """
    request = import_etcd3().etcdrpc.StatusRequest()
    response = client.maintenancestub.Status(
        request, timeout, credentials=client.call_credentials, metadata=client.metadata
    )
    return MemberStatus(
        int(response.header.member_id), int(response.leader), int(response.header.raft_term)
    )


class LeaderRoute:
    """The current belief about the leader's endpoint, found by asking the members.

    Args:
        endpoint_count: number of configured endpoints (indices ``0 .. n-1``).
        status: ``status(client, timeout)``, normally :func:`member_status`.
        clock: for the belief's age.
    """

    def __init__(
        self,
        endpoint_count: int,
        status: Callable[[Any, float], MemberStatus] = member_status,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._count = endpoint_count
        self._status = status
        self._clock = clock
        self._lock = threading.Lock()
        self._belief: LeaderBelief | None = None
        self._member_ids: dict[int, int] = {}  # endpoint index -> member id it reported
        self._unknown_reported: set[int] = set()
        self._failed_at = float("-inf")

    @property
    def belief(self) -> LeaderBelief | None:
        return self._belief

    def find(
        self, home_index: int, home: Any, client_for: Callable[[int], Any], timeout: float
    ) -> LeaderBelief:
        """The belief, asking the home member (and, for an unknown leader id or none, every other
        endpoint) when there is none or it is older than :data:`BELIEF_S`.

        Raises:
            LeaderUnknownError: no member asked knows a leader, or a lookup failed while this
                thread waited for it.
            grpc.RpcError, etcd3 errors: the home member did not answer (its caller fails over).
        """
        asked = self._clock()
        belief = self._belief
        if belief is not None and asked - belief.since < BELIEF_S:
            return belief
        with self._lock:
            belief = self._belief
            if belief is not None and self._clock() - belief.since < BELIEF_S:
                return belief  # another thread asked while this one waited
            if self._failed_at >= asked:
                raise LeaderUnknownError("etcd's leader could not be found a moment ago; retrying")
            try:
                self._belief = self._look_up(home_index, home, client_for, timeout)
            except Exception:
                self._failed_at = self._clock()
                raise
            return self._belief

    def _look_up(
        self, home_index: int, home: Any, client_for: Callable[[int], Any], timeout: float
    ) -> LeaderBelief:
        status = self._status(home, min(timeout, LOOKUP_TIMEOUT_S))
        self._member_ids[home_index] = status.member_id
        leader_id, raft_term = status.leader_id, status.raft_term
        if leader_id == 0 or self._index_of(leader_id) is None:
            others = self._probe(home_index, client_for, min(timeout, PROBE_TIMEOUT_S))
            if leader_id == 0:
                knowing = [other for other in others if other.leader_id]
                if not knowing:
                    raise NoLeaderError(
                        f"etcd member {status.member_id:x} and the others that answered know no "
                        "leader (an election is under way)"
                    )
                latest = max(knowing, key=lambda other: other.raft_term)
                leader_id, raft_term = latest.leader_id, latest.raft_term
        index = self._index_of(leader_id)
        if index is None and leader_id not in self._unknown_reported:
            self._unknown_reported.add(leader_id)
            log.info(
                "etcd's leader %x is not among the configured endpoints: requests go through "
                "the member each connection uses",
                leader_id,
            )
        return LeaderBelief(index, leader_id, self._clock(), raft_term)

    def forget(self, belief: LeaderBelief) -> None:
        """Drop ``belief`` if it is still the current one (an attempt on it failed)."""
        with self._lock:
            if self._belief is belief:
                self._belief = None

    def observe_term(self, raft_term: int) -> None:
        """A response came from ``raft_term``: a later term than the belief's means an election
        happened since it was formed, so ask again at the next request."""
        belief = self._belief
        if belief is not None and raft_term > belief.raft_term:
            self.forget(belief)

    def _index_of(self, member_id: int) -> int | None:
        for index, known in self._member_ids.items():
            if known == member_id:
                return index
        return None

    def _probe(
        self, home_index: int, client_for: Callable[[int], Any], timeout: float
    ) -> list[MemberStatus]:
        """Ask every other endpoint for its member id (ids change when a member is replaced) and
        its leader; an endpoint that does not answer is left out (its id unknown this time)."""
        answers = []
        for index in range(self._count):
            if index == home_index:
                continue
            try:
                answer = self._status(client_for(index), timeout)
            except Exception as exc:  # a dead or slow member is what a probe expects to meet
                self._member_ids.pop(index, None)
                log.debug("etcd endpoint %d did not say its member id: %s", index, exc)
                continue
            self._member_ids[index] = answer.member_id
            answers.append(answer)
        return answers
