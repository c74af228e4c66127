"""Is a pool saturated? Then sheddable work (priority < 0) is refused with 429.

An endpoint counts as full when its waiting queue or KV usage is over a threshold, or when its
metrics are too old to trust (GIE's defaults: 5 waiting, 80% KV, 200 ms). A pool is saturated
when every candidate is full: as long as one replica has room, scheduling will find it, so
shedding would only turn away work that could have been served. Critical and default traffic
(priority >= 0) is never shed here; it queues at the engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.state.snapshot import EndpointState

DEFAULT_STALE_SECONDS = 0.2


@dataclass(frozen=True, slots=True)
class SaturationDetector:
    queue_threshold: int = 5
    kv_threshold: float = 0.8
    stale_seconds: float = DEFAULT_STALE_SECONDS

    def endpoint_full(self, endpoint: EndpointState, now: float) -> bool:
        metrics = endpoint.metrics
        return (
            not endpoint.ready
            or endpoint.age(now) > self.stale_seconds
            or metrics.waiting >= self.queue_threshold
            or metrics.kv_usage >= self.kv_threshold
        )

    def saturated(self, candidates: Sequence[EndpointState], now: float) -> bool:
        return all(self.endpoint_full(c, now) for c in candidates)
