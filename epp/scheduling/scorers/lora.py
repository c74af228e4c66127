"""Prefer endpoints where the request's LoRA adapter is loaded (GIE's ``lora-affinity-scorer``).

Loading an adapter costs the engine time and a slot (``--max-loras``); an endpoint already
running it serves at once. Scores follow GIE: 1.0 adapter running, 0.8 a free slot to load it,
0.6 adapter queued to load (no free slot), else 0. Requests without an adapter score 1
everywhere.

Two differences from GIE, both from what real vLLM 0.32 reports (tests/fixtures/vllm):

- An adapter with a request in flight is listed in *both* ``running_lora_adapters`` and
  ``waiting_lora_adapters``. GIE counts used slots as ``len(running) + len(waiting)``, so one
  active adapter fills two slots; epp counts the *union* of the two lists.
- ``vllm:lora_requests_info`` is absent until an endpoint's first request, so ``max_loras`` 0
  means "unknown", not "no slots": such an endpoint (configured to serve the adapter) is
  assumed to have room.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, Scorer, register
from epp.state.snapshot import EndpointMetrics, EndpointState


class AdapterFit(Enum):
    """How well an endpoint can serve an adapter right now; the value is GIE's score."""

    RUNNING = 1.0
    ROOM = 0.8
    WAITING = 0.6
    FULL = 0.0


def adapter_fit(metrics: EndpointMetrics, adapter: str) -> AdapterFit:
    if adapter in metrics.running_loras:
        return AdapterFit.RUNNING
    used = len(metrics.running_loras | metrics.waiting_loras)
    if metrics.max_loras == 0 or used < metrics.max_loras:
        return AdapterFit.ROOM
    if adapter in metrics.waiting_loras:
        return AdapterFit.WAITING
    return AdapterFit.FULL


@register("lora-affinity-scorer")
class LoraAffinityScorer(Scorer):
    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        adapter = request.lora
        if adapter is None:
            return [1.0] * len(candidates)
        return [adapter_fit(c.metrics, adapter).value for c in candidates]
