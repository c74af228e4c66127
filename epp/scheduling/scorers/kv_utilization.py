"""Prefer endpoints with free KV cache (GIE's ``kv-cache-utilization-scorer``): 1 - usage."""

from __future__ import annotations

from collections.abc import Sequence

from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, Scorer, register
from epp.state.snapshot import EndpointState


@register("kv-cache-utilization-scorer")
class KvCacheUtilizationScorer(Scorer):
    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        return [min(1.0, max(0.0, 1.0 - c.metrics.kv_usage)) for c in candidates]
