"""Which endpoint most recently received a prompt that no endpoint had cached.

The no-hit-LRU scorer (:mod:`epp.scheduling.scorers.no_hit_lru`) spreads such prompts by this
order. It is what scoring learns across requests, so it lives in the fleet state and survives a
configuration reload. Per process: with several epps each spreads the cold prompts it routes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# Endpoints remembered; beyond it the one that received a cold prompt longest ago is dropped,
# which ranks it exactly as before (never received one: first in line). Bounds the memory of a
# fleet whose endpoints come and go (new pod addresses) without a hook for removals.
LIMIT = 4096


class ColdPicks:
    def __init__(self, limit: int = LIMIT) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def record(self, endpoint: str) -> None:
        """``endpoint`` just received a prompt cached nowhere: it goes to the back of the line."""
        order = self._order
        order[endpoint] = None
        order.move_to_end(endpoint)
        if len(order) > self._limit:
            order.popitem(last=False)

    def ranks(self, endpoints: Sequence[str]) -> list[int]:
        """Each endpoint's place in line for the next cold prompt (0: first; endpoints that
        never received one come first, in the order given)."""
        position = {address: i for i, address in enumerate(self._order)}
        # Never used: before everything recorded, keeping the given order among themselves.
        keys = [position.get(address, -len(endpoints) + i) for i, address in enumerate(endpoints)]
        order = sorted(range(len(endpoints)), key=keys.__getitem__)
        ranks = [0] * len(endpoints)
        for rank, index in enumerate(order):
            ranks[index] = rank
        return ranks
