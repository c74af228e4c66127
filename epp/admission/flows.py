"""Bounds on the flows (fairness ids) and priorities one epp process keeps state for.

Every fairness id a request carries becomes state: a budget account per tenant (and its keys
in Redis), a flow in the flow-control queue, a row in the group's queue view published every
exchange tick, a label value. Ids come from trusted sources only (docs/admission.md), but a
trusted source can still hand out a fresh id per request. So per window (a minute) a process
keeps at most :data:`MAX_FLOWS` new ids; the ones it already kept in the previous window stay
(up to twice that), and every further id, and every id longer than :data:`MAX_FLOW_ID_BYTES`,
is folded into one flow, :data:`OTHER_FLOW`, which shares one budget and one fairness turn.
The configured tenants (budgets, API keys) and the default flow always pass.

Priorities are ints a trusted gateway may send; each distinct one is a band and a label value.
Per window at most :data:`MAX_PRIORITIES` priorities beyond the configured ones (0, the
objectives', the flow-control bands') pass; a further one runs at the highest configured
priority not above it (never higher than it asked), or the lowest configured one.

Metric labels go further: only configured names and priorities appear as label values,
everything else is ``other`` (:meth:`FlowBound.flow_label`, :meth:`FlowBound.priority_label`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from epp import wire

OTHER_FLOW = "other-flows"
OTHER_LABEL = "other"
MAX_FLOWS = 1000
MAX_FLOW_ID_BYTES = 128
MAX_PRIORITIES = 16
WINDOW_SECONDS = 60.0


class _Recent:
    """Values seen this window and the last: new ones up to ``limit`` per window, the last
    window's ones up to twice that (so a window boundary does not hand their slots to
    newcomers)."""

    __slots__ = ("current", "limit", "previous", "started")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.current: set[object] = set()
        self.previous: set[object] = set()
        self.started: float | None = None

    def admit(self, value: object, now: float, window: float) -> bool:
        if self.started is None or now - self.started >= window:
            # A gap of two windows leaves nothing to carry over.
            stale = self.started is None or now - self.started >= 2 * window
            self.previous = set() if stale else self.current
            self.current = set()
            self.started = now
        if value in self.current:
            return True
        room = 2 * self.limit if value in self.previous else self.limit
        if len(self.current) < room:
            self.current.add(value)
            return True
        return False


class FlowBound:
    """One process's bound on distinct fairness ids and priorities (see the module doc)."""

    def __init__(
        self,
        max_flows: int = MAX_FLOWS,
        max_priorities: int = MAX_PRIORITIES,
        window: float = WINDOW_SECONDS,
    ) -> None:
        self.window = window
        self._flows = _Recent(max_flows)
        self._priorities = _Recent(max_priorities)
        self._tenants: frozenset[str] = frozenset({wire.DEFAULT_FLOW})
        self._known: list[int] = [0]

    def configure(self, tenants: Iterable[str], priorities: Iterable[int]) -> None:
        """The configured tenants and priorities: always kept, and the only label values."""
        self._tenants = frozenset({wire.DEFAULT_FLOW, *tenants})
        self._known = sorted({0, *priorities})

    def flow(self, fairness_id: str, now: float) -> str:
        """The flow a request with ``fairness_id`` is kept under."""
        if fairness_id in self._tenants:
            return fairness_id
        if len(fairness_id.encode("utf-8", "surrogatepass")) > MAX_FLOW_ID_BYTES:
            return OTHER_FLOW
        return fairness_id if self._flows.admit(fairness_id, now, self.window) else OTHER_FLOW

    def priority(self, priority: int, now: float) -> int:
        """The priority a request asking for ``priority`` is queued at."""
        known = self._known
        if priority in known or self._priorities.admit(priority, now, self.window):
            return priority
        below = bisect.bisect_right(known, priority)
        return known[below - 1] if below else known[0]

    def flow_label(self, flow: str) -> str:
        """A bounded label value for ``flow``: a configured tenant, else ``other``."""
        return flow if flow in self._tenants else OTHER_LABEL

    def priority_label(self, priority: int) -> str:
        """A bounded label value for ``priority``: a configured priority, else ``other``."""
        return str(priority) if priority in self._known else OTHER_LABEL
