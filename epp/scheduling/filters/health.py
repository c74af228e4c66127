"""Endpoints that passive health ejected do not serve, except half-open trial requests.

The circuits live in the fleet state (:class:`~epp.state.health.HealthTracker`), judged from
the responses each endpoint served; this filter only reads them. Every profile gets it, like
the readiness filter (the profile builder adds it when a profile does not list it). When every
candidate is ejected (the pool's ejection cap keeps one endpoint per pool in, but other filters
may have removed that one), all of them are kept: trying a doubtful endpoint beats refusing.
"""

from __future__ import annotations

from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, Filter, register
from epp.state.snapshot import EndpointState


@register("health-filter")
class HealthFilter(Filter):
    # After readiness (stage 0), before the request-specific filters.
    stage = 10

    def filter(
        self, request: InferenceRequest, candidates: list[EndpointState], cycle: Cycle
    ) -> list[EndpointState]:
        health = cycle.fleet.health
        kept = [c for c in candidates if health.admits(c.address, cycle.now)]
        return kept or candidates
