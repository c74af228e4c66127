"""Prefer endpoints with more configured capacity (pool endpoint ``weight``, default 1.0).

Score = weight / largest weight among the candidates, so the biggest replica scores 1 and one
of half its weight 0.5. Used with load scorers it is a bias, not a share: between replicas that
look equally loaded the bigger one wins, and it keeps winning until its load exceeds the smaller
one's by enough to outweigh the difference. For loads kept proportional to capacity, use the
``inflight-load-scorer``, which divides each endpoint's outstanding work by its weight.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, Scorer, register
from epp.state.snapshot import EndpointState


@register("capacity-scorer")
class CapacityScorer(Scorer):
    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        weights = [cycle.weights.get(c.address, 1.0) for c in candidates]
        top = max(weights)
        return [w / top for w in weights]
