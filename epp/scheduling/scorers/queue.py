"""Prefer endpoints with shorter waiting queues (GIE's ``queue-scorer``).

Scores are min-max normalised over the candidates, so the shortest queue always scores 1 and the
longest 0 whatever the absolute depth; all equal scores 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, Scorer, register
from epp.state.snapshot import EndpointState


@register("queue-scorer")
class QueueScorer(Scorer):
    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        queues = [c.metrics.waiting for c in candidates]
        low, high = min(queues), max(queues)
        if high == low:
            return [1.0] * len(queues)
        span = high - low
        return [(high - q) / span for q in queues]
