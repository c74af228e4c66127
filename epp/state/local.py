"""The copy-on-write endpoint table every store backend keeps its local view in.

Writers build a new dict and publish a new :class:`Snapshot` with one attribute assignment, so
the picker reads ``current`` without locks and a decision in progress keeps a consistent view.
Kept apart from the backends so MemoryStore and RedisStore share one implementation of it.
"""

from __future__ import annotations

from collections.abc import Iterable

from epp.state.snapshot import EndpointState, Snapshot


class LocalSnapshot:
    """Holds the current :class:`Snapshot`; each change publishes a new one (version + 1)."""

    def __init__(self) -> None:
        self.current = Snapshot()

    def update(self, states: Iterable[EndpointState]) -> bool:
        """Publish ``states`` in one new snapshot; False (and no new snapshot) if none changed."""
        current = self.current.endpoints
        changed = [s for s in states if current.get(s.address) != s]
        if not changed:
            return False
        endpoints = dict(current)
        for state in changed:
            endpoints[state.address] = state
        self.current = Snapshot(endpoints, self.current.version + 1)
        return True

    def retain(self, addresses: Iterable[str]) -> None:
        """Drop endpoints not in ``addresses``."""
        keep = set(addresses)
        current = self.current.endpoints
        if keep.issuperset(current):
            return
        endpoints = {a: s for a, s in current.items() if a in keep}
        self.current = Snapshot(endpoints, self.current.version + 1)
