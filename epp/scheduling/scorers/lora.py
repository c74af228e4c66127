"""Prefer endpoints where the request's LoRA adapter is loaded (GIE's ``lora-affinity-scorer``).

Loading an adapter costs the engine time and a slot (``--max-loras``); an endpoint already
running it serves at once. Scores follow GIE: 1.0 adapter running, 0.8 a free slot to load it,
0.6 adapter queued to load (no free slot), else 0. Requests without an adapter score 1
everywhere. How the metrics are read: :mod:`epp.scheduling.adapters`.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.request import InferenceRequest
from epp.scheduling.adapters import adapter_fit
from epp.scheduling.framework import Cycle, Scorer, register
from epp.state.snapshot import EndpointState


@register("lora-affinity-scorer")
class LoraAffinityScorer(Scorer):
    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        adapter = request.lora
        if adapter is None:
            return [1.0] * len(candidates)
        return [adapter_fit(c.metrics, adapter).value for c in candidates]
