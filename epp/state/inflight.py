"""Requests and tokens epp itself has sent to each endpoint and not yet seen finish.

Scraped metrics are up to one scrape interval old; between two scrapes a burst would otherwise
pile onto whichever replica looked idlest. Counting our own picks the moment they are made (and
releasing them when Envoy closes the request's stream) lets scorers spread a burst at once.
Tokens are the prompt plus the requested output, the work the engine has ahead of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(slots=True)
class Load:
    requests: int = 0
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Ticket:
    """What one pick added, handed back to :meth:`InflightTracker.release` exactly once."""

    endpoint: str
    tokens: int


class InflightTracker:
    """Per-endpoint in-flight counts, local to this process.

    ``remote`` holds the sum of other epp processes' counts when state is shared (Redis); reads
    add it, so every process sees the whole fleet's outstanding work.
    """

    def __init__(self) -> None:
        self._local: dict[str, Load] = {}
        self.remote: Mapping[str, Load] = {}

    def add(self, endpoint: str, tokens: int) -> Ticket:
        load = self._local.get(endpoint)
        if load is None:
            load = self._local[endpoint] = Load()
        load.requests += 1
        load.tokens += tokens
        return Ticket(endpoint, tokens)

    def move(self, ticket: Ticket, endpoint: str) -> Ticket:
        """The work of ``ticket`` is on ``endpoint`` after all (a retry served it): the new
        ticket replaces the old one, which must not be released."""
        self.release(ticket)
        return self.add(endpoint, ticket.tokens)

    def release(self, ticket: Ticket) -> None:
        load = self._local.get(ticket.endpoint)
        if load is None:
            return
        load.requests = max(0, load.requests - 1)
        load.tokens = max(0, load.tokens - ticket.tokens)

    def load(self, endpoint: str) -> Load:
        local = self._local.get(endpoint)
        remote = self.remote.get(endpoint)
        if remote is None:
            return local or Load()
        if local is None:
            return remote
        return Load(local.requests + remote.requests, local.tokens + remote.tokens)

    def local(self) -> Mapping[str, Load]:
        """This process's own counts (what it shares with the others)."""
        return self._local
