"""Admission hook: flow control holds a request while its pool is saturated (admission mode
``queue``; epp.admission.controller, docs/admission.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from epp.admission.controller import FlowController
from epp.admission.room import Room
from epp.generation import Generation
from epp.lifecycle import Endpoints, Hold, RequestContext
from epp.request import InferenceRequest


class Arrived(Protocol):
    """Counts a request as demand on the pools of ``addresses`` (None: all of ``model``'s)."""

    def __call__(self, model: str, addresses: Sequence[str] | None = None) -> None: ...


class FlowHold:
    """Holds the request in its model's queue until the pool has room for its priority, and
    then lets it go only to a candidate with room."""

    name = "flow-control"

    def __init__(self, flow: FlowController, room: Room, arrived: Arrived) -> None:
        self._flow = flow
        self._room = room
        self._arrived = arrived

    def admit(self, context: RequestContext, request: InferenceRequest) -> Hold | None:
        if context.generation.config.flow_control.mode != "queue":
            return None
        if not self._room.serves(request.model):
            return None  # the scheduler answers 404
        # Demand counts on arrival, before any wait: requests held for a pool with no ready
        # replica are what must scale it from zero.
        self._arrived(request.model)
        self._room.arrived(request.priority, request.prompt_tokens())
        return lambda: self._flow.admit(request.model, request.priority, request.fairness_id)

    def withdraw(self, context: RequestContext) -> None:
        """Nothing to give back: a request leaves the queue when its hold is cancelled."""

    def narrow(
        self, gen: Generation, request: InferenceRequest, found: Endpoints, now: float
    ) -> Endpoints:
        if gen.config.flow_control.mode != "queue":
            return found
        return self._room.with_room(found, request.priority, now)
