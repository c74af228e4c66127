"""Which endpoint most recently received a prompt that no endpoint had cached.

The no-hit-LRU scorer (:mod:`epp.scheduling.scorers.no_hit_lru`) spreads such prompts by this
order. It is what scoring learns across requests, so it lives in the fleet state and survives a
configuration reload. Per process: with several epps each spreads the cold prompts it routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

# Endpoints remembered; beyond it the one that received a cold prompt longest ago is dropped,
# which ranks it exactly as before (never received one: first in line). Bounds the memory of a
# fleet whose endpoints come and go (new pod addresses) without a hook for removals.
LIMIT = 4096


class ColdPicks:
    def __init__(self, limit: int = LIMIT) -> None:
        # Endpoint -> when it last received a cold prompt, as a rising sequence number.
        self._stamps: dict[str, int] = {}
        self._next = count()
        self._limit = limit

    def record(self, endpoint: str) -> None:
        """``endpoint`` just received a prompt cached nowhere: it goes to the back of the line."""
        stamps = self._stamps
        stamps.pop(endpoint, None)  # re-inserted last: the dict's order stays oldest first
        stamps[endpoint] = next(self._next)
        if len(stamps) > self._limit:
            del stamps[next(iter(stamps))]

    def ranks(self, endpoints: Sequence[str]) -> list[int]:
        """Each endpoint's place in line for the next cold prompt (0: first; endpoints that
        never received one come first, in the order given)."""
        stamps = self._stamps
        order = sorted(range(len(endpoints)), key=lambda i: stamps.get(endpoints[i], -1))
        ranks = [0] * len(endpoints)
        for rank, index in enumerate(order):
            ranks[index] = rank
        return ranks
