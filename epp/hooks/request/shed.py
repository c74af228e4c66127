"""Admission hook: sheddable work (priority < 0) is refused with 429 while its pool is
saturated (admission mode ``shed``, docs/admission.md)."""

from __future__ import annotations

import time

from epp import errors
from epp.admission.room import Room
from epp.hooks.request.flow import Arrived
from epp.lifecycle import Hold, RequestContext
from epp.request import InferenceRequest
from epp.state.fleet import FleetState


class Shed:
    """Refuses a sheddable request when every candidate the gateway allows is full."""

    name = "shed"

    def __init__(self, fleet: FleetState, room: Room, arrived: Arrived) -> None:
        self._fleet = fleet
        self._room = room
        self._arrived = arrived

    def admit(self, context: RequestContext, request: InferenceRequest) -> Hold | None:
        config = context.generation.config
        if config.flow_control.mode != "shed" or request.priority >= 0:
            return None
        candidates = self._room.candidates(request.model, context.subset)
        if not candidates:
            return None  # the scheduler answers 404 or 503
        load = self._fleet.inflight.load
        if not config.admission.saturated(candidates, time.time(), load, True):
            return None
        # Refused, it is still demand that should scale the pool up.
        subset = None if context.subset is None else [c.address for c in candidates]
        self._arrived(request.model, subset)
        raise errors.overloaded(request.model)

    def withdraw(self, context: RequestContext) -> None:
        """Nothing taken."""
