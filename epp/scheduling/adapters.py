"""How well an endpoint can serve a LoRA adapter now, read from vLLM's metrics.

Shared by ``lora-filter`` and ``lora-affinity-scorer`` so both read the metrics alike. Two
differences from GIE, both from what real vLLM 0.32 reports (tests/fixtures/vllm):

- An adapter with a request in flight is listed in *both* ``running_lora_adapters`` and
  ``waiting_lora_adapters``. GIE counts used slots as ``len(running) + len(waiting)``, so one
  active adapter fills two slots; epp counts the *union* of the two lists.
- ``vllm:lora_requests_info`` is absent until an endpoint's first request, so ``max_loras`` 0
  means "unknown", not "no slots": such an endpoint (configured to serve the adapter) is
  assumed to have room.
"""

from __future__ import annotations

from enum import Enum

from epp.state.snapshot import EndpointMetrics


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
