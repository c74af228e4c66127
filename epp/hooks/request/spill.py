"""Admission hook: spill-eligible work goes to an overflow pool while its home pool is
saturated (epp.admission.spillover, docs/admission.md)."""

from __future__ import annotations

import time

from epp.admission.room import Room
from epp.lifecycle import Hold, RequestContext
from epp.request import InferenceRequest
from epp.state.fleet import FleetState


class Spill:
    """Sets the verdict's overflow pool; the hooks after it (flow control, shedding) are
    skipped for a spilled request."""

    name = "spill"

    def __init__(self, fleet: FleetState, room: Room) -> None:
        self._fleet = fleet
        self._room = room

    def admit(self, context: RequestContext, request: InferenceRequest) -> Hold | None:
        context.admission.spill = self.target(context, request)
        return None

    def target(self, context: RequestContext, request: InferenceRequest) -> str | None:
        """The overflow pool ``request`` goes to instead of its saturated home pool, or None.
        Only spill-eligible objectives ever spill."""
        config = context.generation.config
        spec = config.models.get(request.model)
        if spec is None or request.objective not in config.request.spill_objectives:
            return None
        endpoints = self._fleet.store.snapshot().endpoints
        load = self._fleet.inflight.load
        now = time.time()
        return config.spillover.target(
            config.spillover.overflow_for(spec.pools),
            lambda: self._room.saturated(request.model, request.priority),
            lambda name: config.spillover.saturated(name, endpoints, config.admission, load, now),
        )

    def withdraw(self, context: RequestContext) -> None:
        """Nothing taken: the spill's in-flight count starts when the request is answered."""
