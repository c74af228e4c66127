"""Keep endpoints that can serve the request's LoRA adapter without waiting for a slot.

An endpoint qualifies if the adapter is running there or it has a free adapter slot (see
:func:`~epp.scheduling.adapters.adapter_fit` for how vLLM's metrics are read). If none
qualifies every candidate is kept: the engine queues the request until a slot frees, which
beats refusing it. Requests without an adapter pass untouched.

GIE's ``lora-affinity-filter`` also keeps endpoints where the adapter is merely waiting, and
picks between "affinity" and "available" groups at random; epp leaves that trade-off to the
``lora-affinity-scorer`` (0.6 for waiting), so the filter only removes clearly worse choices.
"""

from __future__ import annotations

from epp.request import InferenceRequest
from epp.scheduling.adapters import AdapterFit, adapter_fit
from epp.scheduling.framework import Cycle, Filter, register
from epp.state.snapshot import EndpointState

_SERVES_NOW = (AdapterFit.RUNNING, AdapterFit.ROOM)


@register("lora-filter")
class LoraFilter(Filter):
    stage = 10

    def filter(
        self, request: InferenceRequest, candidates: list[EndpointState], cycle: Cycle
    ) -> list[EndpointState]:
        adapter = request.lora
        if adapter is None:
            return candidates
        kept = [c for c in candidates if adapter_fit(c.metrics, adapter) in _SERVES_NOW]
        return kept or candidates
