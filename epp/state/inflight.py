"""Requests and tokens epp itself has sent to each endpoint and not yet seen finish.

Scraped metrics are up to one scrape interval old; between two scrapes a burst would otherwise
pile onto whichever replica looked idlest. Counting our own picks the moment they are made (and
releasing them when Envoy closes the request's stream) lets scorers spread a burst at once.
Tokens are the prompt plus the requested output, the work the engine has ahead of it.

Until its first token arrives a request is also *prefilling*: its uncached prompt tokens are
prefill work the endpoint still has to do, ahead of any request sent after it (vLLM schedules
FCFS). The response path reports the first token (:meth:`InflightTracker.prefilled`), so
``prefill`` and ``waiting`` count exactly the prefill queued on each endpoint, the latency
model's queueing input (:mod:`epp.state.latency`).

A disaggregated request (docs/pd.md) also puts its prefill leg on the prefill replica: that
replica counts one request prefilling the prompt tokens it does not cache, from the pick until
the decode replica's first token, which the decode sidecar sends only after the prefill leg
answered (or failed, and the decode replica prefilled itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epp.state.latency import Basis


@dataclass(slots=True)
class Load:
    requests: int = 0
    tokens: int = 0
    # Uncached prompt tokens of the requests still waiting for their first token, and how many.
    prefill: int = 0
    waiting: int = 0

    @property
    def decoding(self) -> int:
        """Requests past their first token: the endpoint's decode batch, as far as epp knows."""
        return max(0, self.requests - self.waiting)


@dataclass(frozen=True, slots=True)
class Ticket:
    """What one pick added, handed back to :meth:`InflightTracker.release` exactly once.

    ``prefill`` is the request's uncached prompt while it waits for its first token (0 after
    :meth:`InflightTracker.prefilled`); ``basis`` what the latency model predicted at the pick,
    learned from when the first token arrives (None: nothing to learn, e.g. after a retry).
    """

    endpoint: str
    tokens: int
    prefill: int = 0
    waiting: bool = True
    basis: Basis | None = None
    # Disaggregated: the prefill replica running the prefill leg and the uncached prompt tokens
    # counted there while ``waiting`` ("" and 0 otherwise, and once the first token arrived).
    prefiller: str = ""
    prefiller_tokens: int = 0


# What an endpoint with nothing in flight reads as: one instance, as scorers ask for every
# candidate of every request (never mutated: :meth:`InflightTracker.add` makes its own).
_IDLE = Load()


class InflightTracker:
    """Per-endpoint in-flight counts, local to this process.

    ``remote`` holds the sum of other epp processes' counts when state is shared (Redis); reads
    add it, so every process sees the whole fleet's outstanding work.
    """

    def __init__(self) -> None:
        self._local: dict[str, Load] = {}
        self.remote: Mapping[str, Load] = {}

    def add(
        self,
        endpoint: str,
        tokens: int,
        prefill: int = 0,
        basis: Basis | None = None,
        prefiller: str = "",
        prefiller_tokens: int = 0,
    ) -> Ticket:
        """Count a request on ``endpoint``, and its prefill leg on ``prefiller`` if given."""
        self._count(endpoint, tokens, prefill)
        if prefiller:
            self._count(prefiller, prefiller_tokens, prefiller_tokens)
        return Ticket(endpoint, tokens, prefill, True, basis, prefiller, prefiller_tokens)

    def move(self, ticket: Ticket, endpoint: str) -> Ticket:
        """The work of ``ticket`` is on ``endpoint`` after all (a retry served it): the new
        ticket replaces the old one, which must not be released. What was predicted for the
        picked endpoint says nothing about this one: the new ticket has no basis."""
        self.release(ticket)
        moved = self.add(
            endpoint, ticket.tokens, ticket.prefill, None, ticket.prefiller, ticket.prefiller_tokens
        )
        if not ticket.waiting:
            return self.prefilled(moved)
        return moved

    def prefilled(self, ticket: Ticket) -> Ticket:
        """The request's first token arrived: its prefill is done. Returns the ticket that
        replaces ``ticket`` (release that one)."""
        if not ticket.waiting:
            return ticket
        load = self._local.get(ticket.endpoint)
        if load is not None:
            load.prefill = max(0, load.prefill - ticket.prefill)
            load.waiting = max(0, load.waiting - 1)
        self._release_prefiller(ticket)
        return replace(ticket, prefill=0, waiting=False, prefiller="", prefiller_tokens=0)

    def release(self, ticket: Ticket) -> None:
        if ticket.waiting:
            self._release_prefiller(ticket)
        self._drop(ticket.endpoint, ticket.tokens, ticket.prefill, ticket.waiting)

    def _count(self, endpoint: str, tokens: int, prefill: int) -> None:
        load = self._local.get(endpoint)
        if load is None:
            load = self._local[endpoint] = Load()
        load.requests += 1
        load.tokens += tokens
        load.prefill += prefill
        load.waiting += 1

    def _drop(self, endpoint: str, tokens: int, prefill: int, waiting: bool) -> None:
        load = self._local.get(endpoint)
        if load is None:
            return
        load.requests = max(0, load.requests - 1)
        load.tokens = max(0, load.tokens - tokens)
        if waiting:
            load.prefill = max(0, load.prefill - prefill)
            load.waiting = max(0, load.waiting - 1)

    def _release_prefiller(self, ticket: Ticket) -> None:
        """The prefill leg of ``ticket`` is over: nothing of it counts on its replica."""
        if ticket.prefiller:
            self._drop(ticket.prefiller, ticket.prefiller_tokens, ticket.prefiller_tokens, True)

    def load(self, endpoint: str) -> Load:
        """What is in flight on ``endpoint``; read-only (it may be the tracker's own count, or
        the one shared idle load)."""
        local = self._local.get(endpoint)
        remote = self.remote.get(endpoint)
        if remote is None:
            return local or _IDLE
        if local is None:
            return remote
        return Load(
            local.requests + remote.requests,
            local.tokens + remote.tokens,
            local.prefill + remote.prefill,
            local.waiting + remote.waiting,
        )

    def local(self) -> Mapping[str, Load]:
        """This process's own counts (what it shares with the others)."""
        return self._local
