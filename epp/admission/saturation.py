"""Is a pool saturated? Then flow control holds new requests (or, in ``shed`` mode, sheddable
work, priority < 0, is refused with 429).

Two signals, both per endpoint (GIE's utilisation and concurrency detectors):

- utilisation: its waiting queue or KV usage is over a threshold, or its metrics are too old
  to trust (GIE's defaults: 5 waiting, 80% KV, 200 ms) -- stale metrics count as full;
- concurrency: epp's own in-flight count for it (requests, or prompt + output tokens) has
  reached ``max_requests`` / ``max_tokens`` (0 turns a limit off). This one moves the moment a
  request is routed or finishes, so it gates a burst between two scrapes.

A pool is saturated when every candidate is full: as long as one replica has room, scheduling
will find it, so holding would only starve the fleet.

``sheddable_reserve`` keeps a share of the concurrency limits for priority >= 0: sheddable work
sees an endpoint as full at ``(1 - reserve) x`` the limits. The in-flight counts are shared by
every epp of a group (Redis), so the reserve holds across processes although each process
queues its own requests: critical traffic entering through one epp finds room that batch traffic
entering through another cannot take.

``pool_reserve`` is the same idea for the pool as a whole, counted in requests: sheddable work
may fill an endpoint up to its whole ``max_requests`` as long as the pool keeps room for
``pool_reserve`` more requests on endpoints that are otherwise not full. A per-endpoint
reserve leaves every endpoint's share empty at once (a fleet held at ``(1 - reserve)`` of its
KV); a pool reserve leaves free only the slots it names, wherever they are, and routing sends
critical work there (docs/admission.md; docs/overload.md measures what it costs critical).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from epp.state.inflight import Load
from epp.state.snapshot import EndpointState

DEFAULT_STALE_SECONDS = 0.2


@dataclass(frozen=True, slots=True)
class SaturationDetector:
    queue_threshold: int = 5
    kv_threshold: float = 0.8
    stale_seconds: float = DEFAULT_STALE_SECONDS
    max_requests: int = 0
    max_tokens: int = 0
    sheddable_reserve: float = 0.0
    pool_reserve: int = 0

    def endpoint_full(
        self,
        endpoint: EndpointState,
        now: float,
        load: Load | None = None,
        sheddable: bool = False,
        kv: bool = True,
    ) -> bool:
        """Over a limit or a utilisation threshold (``kv``: KV use counts; admission driven
        by objectives measures KV in decode slots instead, epp.admission.objectives)."""
        metrics = endpoint.metrics
        share = 1.0 - self.sheddable_reserve if sheddable else 1.0
        if load is not None and (
            (self.max_requests and load.requests >= max(1, int(self.max_requests * share)))
            or (self.max_tokens and load.tokens >= max(1, int(self.max_tokens * share)))
        ):
            return True
        return (
            not endpoint.ready
            or endpoint.age(now) > self.stale_seconds
            or metrics.waiting >= self.queue_threshold
            or (kv and metrics.kv_usage >= self.kv_threshold)
        )

    def saturated(
        self,
        candidates: Sequence[EndpointState],
        now: float,
        load: Callable[[str], Load] | None = None,
        sheddable: bool = False,
    ) -> bool:
        """Every candidate is full (an empty pool, scaling from zero, is saturated too); for
        sheddable work also when the pool's room is down to ``pool_reserve``."""
        if (
            sheddable
            and self.pool_reserve
            and load is not None
            and self.room(candidates, now, load) <= self.pool_reserve
        ):
            return True
        return all(
            self.endpoint_full(c, now, None if load is None else load(c.address), sheddable)
            for c in candidates
        )

    def room(
        self, candidates: Sequence[EndpointState], now: float, load: Callable[[str], Load]
    ) -> int:
        """Requests of priority >= 0 the pool could still take under ``max_requests``: the free
        slots of every endpoint that is not full for them (utilisation, staleness, tokens)."""
        free = 0
        for c in candidates:
            current = load(c.address)
            if not self.endpoint_full(c, now, current):
                free += self.max_requests - current.requests
        return free
