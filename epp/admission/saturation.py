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

    def endpoint_full(
        self,
        endpoint: EndpointState,
        now: float,
        load: Load | None = None,
        sheddable: bool = False,
    ) -> bool:
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
            or metrics.kv_usage >= self.kv_threshold
        )

    def saturated(
        self,
        candidates: Sequence[EndpointState],
        now: float,
        load: Callable[[str], Load] | None = None,
        sheddable: bool = False,
    ) -> bool:
        """Every candidate is full (an empty pool, scaling from zero, is saturated too)."""
        return all(
            self.endpoint_full(c, now, None if load is None else load(c.address), sheddable)
            for c in candidates
        )
