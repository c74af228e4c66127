"""``least-picked-scorer``: prefer the endpoints the whole epp group picked least.

A worked example of a stateful plugin kept in one folder (docs/extending.md): its state, how
that state replicates through Redis, and the scorer reading it. Nothing in ``epp/`` names it;
importing this module registers the plugin type and declares its state.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, PostPick, Scorer, register
from epp.state.registry import Replication, StateKey
from epp.state.shared import wire
from epp.state.snapshot import EndpointState

# Bounds on what other processes can make this state hold: endpoints kept, and one item's count.
MAX_ENDPOINTS = 10_000
MAX_COUNT = 1_000


class Picked(NamedTuple):
    """What one process ships: ``count`` picks of ``endpoint``."""

    endpoint: str
    count: int


class PickCounts:
    """Picks per endpoint, this process's and the group's (the state kept across reloads)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        # Local picks not yet shipped; the oldest go first when nobody collects them.
        self._recent: deque[Picked] = deque(maxlen=4096)

    def add(self, endpoint: str) -> None:
        self._count(endpoint, 1)
        self._recent.append(Picked(endpoint, 1))

    # What the pick stream needs of a replicated state:
    def take_recent(self) -> list[Picked]:
        batch = list(self._recent)
        self._recent.clear()
        return batch

    def recent_count(self) -> int:
        return len(self._recent)

    def apply(self, batch: Iterable[Picked]) -> None:
        for endpoint, count in batch:
            self._count(endpoint, count)

    def _count(self, endpoint: str, count: int) -> None:
        if endpoint in self.counts or len(self.counts) < MAX_ENDPOINTS:
            self.counts[endpoint] += count


def _bounded(item: Picked, _now: float) -> Picked:
    """An item from another process, refused unless its count is within bounds."""
    if not 1 <= item.count <= MAX_COUNT:
        raise wire.Malformed(f"a pick count must be 1..{MAX_COUNT}, got {item.count}")
    return item


# No parameters change what a count means: one instance, replicated under the tag
# ``least-picked``.
PICKS = StateKey("least-picked", PickCounts, replicated=Replication(Picked, _bounded))


@register("least-picked-scorer")
class LeastPickedScorer(Scorer, PostPick):
    """Score 1 for the endpoints picked least across the group, down to 0 for the most."""

    states = (PICKS,)

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        counts = cycle.fleet.states.get(PICKS).counts
        picked = [counts[c.address] for c in candidates]
        most = max(picked, default=0)
        return [1.0 - n / most if most else 1.0 for n in picked]

    def on_pick(self, request: InferenceRequest, endpoint: EndpointState, cycle: Cycle) -> None:
        cycle.fleet.states.get(PICKS).add(endpoint.address)
