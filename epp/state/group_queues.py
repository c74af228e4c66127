"""Cluster-wide flow control: priority bands and fairness shares that hold for a group of epps.

Each epp process queues its own requests (:mod:`epp.admission.controller`). Alone, its order
holds only for itself: a tenant that reaches two epps gets a share in each, and one epp may
dispatch batch work while another holds critical work. This module is the group's view of
everyone's queues, so that each process's dispatcher can yield a freed slot to work waiting
elsewhere.

Pure bookkeeping, no I/O and no clock of its own (every call takes ``now``), so the decisions
are unit-tested with a fake clock. The shared-state loop (:mod:`epp.state.shared.sync`)
publishes :meth:`GroupQueues.export` to Redis on its background tick and hands back what the
other processes published (:meth:`GroupQueues.apply`); the dispatcher asks :meth:`choose` and
:meth:`waiting` from memory, so the hot path never waits on Redis.

What travels, per (pool key, priority band, fairness id): how many requests the process holds
and how many it has dispatched so far (a cumulative count). Every reader turns the others'
count increases, plus its own dispatches, into the group's **served** count per flow: an
exponentially decaying sum (time constant :data:`SERVED_TAU`), so history fades and a flow
that comes back after a quiet spell does not claim the slots of a whole past hour.

Dispatch within a band picks the local flow served least group-wide (ties: the local
round-robin order), and yields (returns None) when

- a higher band of the same pool waits in another process, or
- a flow waiting only in another process has been served at least :data:`MARGIN` dispatch
  less than every flow waiting here.

Yielding is bounded (:meth:`GroupQueues.pick`, :attr:`GroupQueues.hold`): if no other process
takes the room within that time, the local head goes anyway, so the pool is never left idle
for work that is not coming (work-conserving). A view older than :attr:`GroupQueues.stale`
(Redis slow or down) is ignored and each process falls back to its own order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from epp.observability import FLOW_YIELDS

# Served counts decay with this time constant (seconds): long enough to even out shares over
# many dispatches, short enough that a flow back from a quiet minute starts nearly even.
SERVED_TAU = 10.0
# A flow waiting elsewhere gets the room only if it trails by at least one dispatch: smaller
# gaps are the lag of the exchange itself and yielding for them would only idle the slot.
MARGIN = 1.0
# A process yields for at most this many exchange intervals: the other process sees the room
# one publish (its in-flight counts) plus one read later, and needs a dispatch tick to take it.
HOLD_INTERVALS = 4
# A view is trusted for this many exchange intervals (a tick may be late on a loaded machine).
STALE_INTERVALS = 10
# A local row with nothing queued and no dispatch for this long is no longer published (and its
# count restarts from 0, which readers count from, since they forget rows that vanish).
IDLE_SECONDS = 30.0
# Without an exchange (memory store) nothing exports; local updates then prune every so often,
# so tables do not grow with every fairness id ever seen.
PRUNE_EVERY = 1024


@dataclass(frozen=True, slots=True)
class Row:
    """One process's demand in one flow: held now, and dispatched since its count started."""

    key: str
    priority: int
    flow: str
    queued: int
    dispatched: int


_Flow = tuple[str, int, str]  # pool key, priority, fairness id


class _Decaying:
    """A count whose past weighs ``exp(-age / tau)``."""

    __slots__ = ("at", "value")

    def __init__(self, now: float) -> None:
        self.value = 0.0
        self.at = now

    def get(self, now: float) -> float:
        return self.value * math.exp(-max(0.0, now - self.at) / SERVED_TAU)

    def add(self, amount: float, now: float) -> None:
        self.value = self.get(now) + amount
        self.at = now


class GroupQueues:
    """This process's flow-control ledger and the last view of the other processes' ledgers.

    Lives in the fleet state (:class:`~epp.state.fleet.FleetState`): it is learned at run time
    and survives configuration reloads.
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.hold = self.stale = 0.0
        self.set_interval(interval)
        # This process: held per flow, cumulative dispatches, and when each flow last moved.
        self._queued: dict[_Flow, int] = {}
        self._dispatched: dict[_Flow, int] = {}
        self._touched: dict[_Flow, float] = {}
        # The group, this process included.
        self._served: dict[_Flow, _Decaying] = {}
        # The others, as of the last view: held per key -> band -> flow, and the counts each
        # member last published (to turn cumulative counts into increases).
        self._remote: dict[str, dict[int, dict[str, int]]] = {}
        self._last: dict[str, dict[_Flow, int]] = {}
        self._viewed_at: float | None = None
        # Pool key -> when its dispatcher started yielding the current room to another process.
        self._yielding: dict[str, float] = {}
        self._updates = 0

    def set_interval(self, interval: float) -> None:
        """Follow the exchange interval (the shared-state tick): hold and staleness derive
        from it."""
        self.hold = HOLD_INTERVALS * interval
        self.stale = STALE_INTERVALS * interval

    # -- this process -------------------------------------------------------------------------

    def queued(self, key: str, priority: int, flow: str, delta: int, now: float) -> None:
        """A request of this process joined (+1) or left (-1) the queue of a flow."""
        f = (key, priority, flow)
        self._queued[f] = self._queued.get(f, 0) + delta
        self._touched[f] = now
        self._updated(now)

    def dispatched(self, key: str, priority: int, flow: str, now: float) -> None:
        """This process released a request of a flow: counted at once in the group's share."""
        f = (key, priority, flow)
        self._dispatched[f] = self._dispatched.get(f, 0) + 1
        self._touched[f] = now
        self._served_of(f, now).add(1.0, now)
        self._updated(now)

    def export(self, now: float) -> list[Row]:
        """The rows to publish; flows idle for :data:`IDLE_SECONDS` are dropped for good."""
        self._prune(now)
        return [
            Row(*f, max(0, self._queued.get(f, 0)), self._dispatched.get(f, 0))
            for f in self._touched
        ]

    def _updated(self, now: float) -> None:
        self._updates += 1
        if self._updates % PRUNE_EVERY == 0:
            self._prune(now)

    def _prune(self, now: float) -> None:
        for f, touched in list(self._touched.items()):
            if self._queued.get(f, 0) <= 0 and now - touched >= IDLE_SECONDS:
                for table in (self._queued, self._dispatched, self._touched):
                    table.pop(f, None)
        self._forget_faded(now)

    # -- the others ---------------------------------------------------------------------------

    def apply(self, views: Mapping[str, Iterable[Row]], now: float) -> None:
        """The other members' rows as just read (a member absent here has left or expired)."""
        remote: dict[str, dict[int, dict[str, int]]] = {}
        last: dict[str, dict[_Flow, int]] = {}
        for member, rows in views.items():
            before = self._last.get(member)
            seen = last[member] = {}
            for row in rows:
                f = (row.key, row.priority, row.flow)
                seen[f] = row.dispatched
                if before is not None:
                    # A row new to a known member counts from 0; a member seen for the first
                    # time is a baseline (its history predates this view).
                    grew = row.dispatched - before.get(f, 0)
                    if grew > 0:
                        self._served_of(f, now).add(grew, now)
                if row.queued > 0:
                    flows = remote.setdefault(row.key, {}).setdefault(row.priority, {})
                    flows[row.flow] = flows.get(row.flow, 0) + row.queued
        self._remote, self._last, self._viewed_at = remote, last, now
        self._forget_faded(now)

    def lose(self) -> None:
        """The exchange failed: no view of the others until the next :meth:`apply`."""
        self._remote, self._last, self._viewed_at = {}, {}, None

    def live(self, now: float) -> bool:
        """Whether the view is fresh enough to act on."""
        return self._viewed_at is not None and now - self._viewed_at <= self.stale

    # -- decisions (hot path: memory only) ----------------------------------------------------

    def waiting(self, key: str, priority: int, now: float) -> bool:
        """Another process holds requests of ``key`` at ``priority`` or higher, as a fresh view
        says (an arrival of that priority then queues rather than overtaking them)."""
        if not self.live(now):
            return False
        bands = self._remote.get(key, {})
        return any(p >= priority and any(flows.values()) for p, flows in bands.items())

    def pick(self, key: str, priority: int, flows: Sequence[str], now: float) -> str | None:
        """The flow to dispatch into the room the pool has now, or None while yielding it to
        another process (for at most :attr:`hold`; then the local turn, ``flows[0]``, goes:
        work-conserving). Without a fresh view: ``flows[0]``, the local order."""
        if not self.live(now):
            self._yielding.pop(key, None)
            return flows[0]
        choice = self.choose(key, priority, flows, now)
        if choice is not None:
            self._yielding.pop(key, None)
            return choice
        since = self._yielding.setdefault(key, now)
        if since == now:
            FLOW_YIELDS.labels(key).inc()
        if now - since < self.hold:
            return None
        self._yielding.pop(key, None)
        return flows[0]

    def no_room(self, key: str) -> None:
        """The pool of ``key`` is full (or nothing waits here): a yield, if any, is over; the
        next room starts a new one."""
        self._yielding.pop(key, None)

    def choose(self, key: str, priority: int, flows: Sequence[str], now: float) -> str | None:
        """Which of the local ``flows`` (band ``priority``, in round-robin order) to dispatch
        next, or None to leave the room to another process (see the module docstring)."""
        bands = self._remote.get(key, {})
        if any(p > priority and any(waiting.values()) for p, waiting in bands.items()):
            return None
        best = min(flows, key=lambda flow: self._served_value((key, priority, flow), now))
        least = self._served_value((key, priority, best), now) - MARGIN
        elsewhere = bands.get(priority, {})
        if any(
            n > 0 and flow not in flows and self._served_value((key, priority, flow), now) <= least
            for flow, n in elsewhere.items()
        ):
            return None
        return best

    def served(self, key: str, priority: int, flow: str, now: float) -> float:
        """The group's decaying dispatch count of a flow (for tests and /debug)."""
        return self._served_value((key, priority, flow), now)

    def _served_value(self, f: _Flow, now: float) -> float:
        counter = self._served.get(f)
        return 0.0 if counter is None else counter.get(now)

    def _served_of(self, f: _Flow, now: float) -> _Decaying:
        counter = self._served.get(f)
        if counter is None:
            counter = self._served[f] = _Decaying(now)
        return counter

    def _forget_faded(self, now: float) -> None:
        """Drop served counts that decayed to nothing for flows nobody holds or publishes."""
        active = set(self._touched) | {f for rows in self._last.values() for f in rows}
        for f in [f for f, c in self._served.items() if f not in active and c.get(now) < 0.01]:
            del self._served[f]
