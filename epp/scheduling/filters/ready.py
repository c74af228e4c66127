"""Only endpoints whose metric source reports them ready may serve.

Every profile has this filter, first: the profile builder adds it when a profile does not list
it (GIE's picker likewise only ever considers ready pods).
"""

from __future__ import annotations

from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, Filter, register
from epp.state.snapshot import EndpointState


@register("ready-endpoint-filter")
class ReadyEndpointFilter(Filter):
    stage = 0

    def filter(
        self, request: InferenceRequest, candidates: list[EndpointState], cycle: Cycle
    ) -> list[EndpointState]:
        return [c for c in candidates if c.ready]
