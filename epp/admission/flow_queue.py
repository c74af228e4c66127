"""The flow-control queue: requests held while their pool is saturated, in release order.

Pure bookkeeping, no I/O and no asyncio, so ordering, fairness, TTL and capacity are unit-tested
with a fake clock; :mod:`epp.admission.controller` puts futures and a dispatch loop around it.

Order (as GIE/llm-d flow control): the highest priority band first; within a band, fairness ids
(flows) take turns round-robin, so a tenant offering ten times the load of another gets the same
dispatch share while both have work waiting; within a flow, first come first served.

Limits: each band has a capacity and a TTL. When the queue as a whole is full, a request of
priority >= 0 evicts the newest sheddable (priority < 0) entry instead of being refused:
sheddable work is always the first refused.

Retry-After: a refused client is told to come back when the queue ahead of it should have
drained: ``ceil((position + 1) / rate)`` seconds, where ``rate`` is the measured dispatch rate
(dispatches per second, an exponentially weighted moving average with a time constant of
:data:`RATE_TAU` seconds) and ``position`` the number of entries that would be dispatched before
it (everything in its band and higher bands). The rate has a floor of :data:`MIN_RATE`, and the
result is clamped to [1, :data:`MAX_RETRY_AFTER`] seconds, so a stalled pool says "a minute",
never "never".
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

T = TypeVar("T")

RATE_TAU = 5.0
MIN_RATE = 0.1
MAX_RETRY_AFTER = 60

# llm-d's names for why a request was dropped (x-epp-request-dropped-reason, REFERENCE §9).
Reason = Literal["rejected-saturated", "rejected-ttl-expired", "rejected-capacity-evicted"]


@dataclass(frozen=True, slots=True)
class BandLimits:
    """How many requests one priority band may hold and how long each may wait."""

    capacity: int = 1000
    ttl: float = 30.0


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """Per-band limits (``bands`` by priority; others use ``default``) and a global capacity."""

    capacity: int = 5000
    default: BandLimits = field(default_factory=BandLimits)
    bands: Mapping[int, BandLimits] = field(default_factory=dict)

    def band(self, priority: int) -> BandLimits:
        return self.bands.get(priority, self.default)

    @property
    def longest_ttl(self) -> float:
        return max([self.default.ttl, *(b.ttl for b in self.bands.values())])


@dataclass(eq=False, slots=True)
class Entry(Generic[T]):
    """One held request: compared by identity, so the same payload may be queued twice."""

    payload: T
    priority: int
    flow: str
    enqueued: float
    deadline: float


@dataclass(frozen=True, slots=True)
class Dropped(Generic[T]):
    """An entry (or an arrival) the queue refused: why, and when to retry."""

    entry: Entry[T]
    reason: Reason
    retry_after: int

    @property
    def status(self) -> int:
        """503 when the wait ran out, 429 when there was no room."""
        return 503 if self.reason == "rejected-ttl-expired" else 429


class _Band(Generic[T]):
    """One priority level: a FIFO per flow, and the flows in round-robin order."""

    __slots__ = ("flows", "size")

    def __init__(self) -> None:
        # Insertion order is the round-robin order; the flow served last moves to the end.
        self.flows: OrderedDict[str, deque[Entry[T]]] = OrderedDict()
        self.size = 0

    def push(self, entry: Entry[T]) -> None:
        self.flows.setdefault(entry.flow, deque()).append(entry)
        self.size += 1

    def pop(self, flow: str | None = None) -> Entry[T]:
        """The head of ``flow`` (default: the flow whose turn it is)."""
        if flow is None:
            flow = next(iter(self.flows))
        fifo = self.flows[flow]
        entry = fifo.popleft()
        del self.flows[flow]
        if fifo:
            self.flows[flow] = fifo  # back of the round-robin
        self.size -= 1
        return entry

    def remove(self, entry: Entry[T]) -> bool:
        fifo = self.flows.get(entry.flow)
        if fifo is None or entry not in fifo:
            return False
        fifo.remove(entry)
        if not fifo:
            del self.flows[entry.flow]
        self.size -= 1
        return True

    def newest(self) -> Entry[T]:
        return max((f[-1] for f in self.flows.values()), key=lambda e: e.enqueued)


class FlowQueue(Generic[T]):
    """Priority bands of round-robin flows of FIFOs, with capacity, TTL and a drain-rate meter."""

    def __init__(self, limits: QueueLimits) -> None:
        self.limits = limits
        self._bands: dict[int, _Band[T]] = {}
        self._size = 0
        self._rate = 0.0
        self._last_dispatch: float | None = None

    def __len__(self) -> int:
        return self._size

    def sizes(self) -> dict[tuple[int, str], int]:
        """Queued entries per (priority, flow), for the queue-size gauge."""
        return {
            (p, flow): len(fifo)
            for p, band in self._bands.items()
            for flow, fifo in band.flows.items()
        }

    def drain_rate(self, now: float) -> float:
        """Dispatches per second, smoothed, decayed to ``now`` (a stalled pool tends to 0)."""
        if self._last_dispatch is None:
            return 0.0
        return self._rate * math.exp(-max(0.0, now - self._last_dispatch) / RATE_TAU)

    def push(
        self, payload: T, priority: int, flow: str, now: float
    ) -> tuple[Entry[T] | None, list[Dropped[T]]]:
        """Queue a request. Returns its entry (None when refused) and every entry dropped to
        make the decision: the arrival itself, or a sheddable entry it displaced."""
        limits = self.limits.band(priority)
        entry = Entry(payload, priority, flow, now, now + limits.ttl)
        band = self._bands.get(priority)
        if band is not None and band.size >= limits.capacity:
            return None, [self._drop(entry, "rejected-saturated", now)]
        dropped: list[Dropped[T]] = []
        if self._size >= self.limits.capacity:
            victim = self._sheddable_victim(priority)
            if victim is None:
                return None, [self._drop(entry, "rejected-saturated", now)]
            self.remove(victim)
            dropped.append(self._drop(victim, "rejected-capacity-evicted", now))
        self._bands.setdefault(priority, _Band()).push(entry)
        self._size += 1
        return entry, dropped

    def _sheddable_victim(self, priority: int) -> Entry[T] | None:
        """The newest entry of the lowest sheddable band below ``priority``, if any."""
        for p in sorted(self._bands):
            if p >= 0 or p >= priority:
                return None
            if self._bands[p].size:
                return self._bands[p].newest()
        return None

    def head_priority(self) -> int | None:
        """The band :meth:`pop` would serve next, or None if empty."""
        return max(self._bands, default=None)

    def flows(self, priority: int) -> list[str]:
        """The flows waiting in band ``priority``, in round-robin order (next turn first)."""
        band = self._bands.get(priority)
        return [] if band is None else list(band.flows)

    def pop(self, now: float, flow: str | None = None) -> Entry[T] | None:
        """The next entry to dispatch (highest band, next flow in turn), or None if empty.
        ``flow`` (waiting in the highest band) overrides the turn: the group's choice
        (:mod:`epp.state.group_queues`); that flow then goes to the back of the round-robin."""
        for p in sorted(self._bands, reverse=True):
            band = self._bands[p]
            if band.size:
                entry = band.pop(flow)
                self._size -= 1
                if not band.size:
                    del self._bands[p]
                self._count_dispatch(now)
                return entry
        return None

    def remove(self, entry: Entry[T]) -> bool:
        """Take an entry out (its client went away); False if it was no longer queued."""
        band = self._bands.get(entry.priority)
        if band is None or not band.remove(entry):
            return False
        self._size -= 1
        if not band.size:
            del self._bands[entry.priority]
        return True

    def expire(self, now: float) -> list[Dropped[T]]:
        """Remove and return every entry whose TTL ran out."""
        expired = [
            e
            for band in self._bands.values()
            for fifo in band.flows.values()
            for e in fifo
            if e.deadline <= now
        ]
        for e in expired:
            self.remove(e)
        return [self._drop(e, "rejected-ttl-expired", now) for e in expired]

    def next_deadline(self) -> float | None:
        """The earliest TTL deadline of a queued entry (the head of each FIFO is its oldest)."""
        heads = [fifo[0].deadline for band in self._bands.values() for fifo in band.flows.values()]
        return min(heads, default=None)

    def retry_after(self, priority: int, now: float) -> int:
        """Seconds until a request of ``priority`` arriving now would be dispatched."""
        ahead = sum(b.size for p, b in self._bands.items() if p >= priority)
        seconds = math.ceil((ahead + 1) / max(self.drain_rate(now), MIN_RATE))
        return max(1, min(MAX_RETRY_AFTER, seconds))

    def _drop(self, entry: Entry[T], reason: Reason, now: float) -> Dropped[T]:
        return Dropped(entry, reason, self.retry_after(entry.priority, now))

    def _count_dispatch(self, now: float) -> None:
        """Update the smoothed dispatch rate: each dispatch is an impulse of 1/tau into an
        exponential decay, so the estimate converges to dispatches per second."""
        last = self._last_dispatch
        self._last_dispatch = now
        if last is None:
            self._rate = 1.0 / RATE_TAU
            return
        decay = math.exp(-max(0.0, now - last) / RATE_TAU)
        self._rate = self._rate * decay + 1.0 / RATE_TAU
