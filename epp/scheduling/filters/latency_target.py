"""Latency targets: send a request only where it is predicted to meet its TTFT target.

A request's target comes from a trusted caller's ``x-llm-d-slo-ttft-ms`` header (llm-d's
name; ignored when ``request.trusted_headers`` is false), else from this plugin's ``ttft_ms``
(the profile's default; 0: none). The router puts it in the cycle (:data:`LATENCY_TARGET`).
The predictions are the ``predicted-latency-scorer``'s (:data:`~epp.scheduling.scorers.
latency.PREDICTED_LATENCY`), a required input.

- Filter: keeps the endpoints predicted to meet the target. When none is, ``on_miss: best``
  keeps them all (the other scorers, the latency scorer among them, pick the least bad) and
  ``on_miss: refuse`` answers 429 ``latency_target_unreachable`` rather than send the request
  to miss its target.
- Scorer: among those that meet it, the one with the least headroom wasted scores highest
  (predicted TTFT / target): a request with a loose target goes to an endpoint that just
  makes it, leaving the fast, idle ones to requests that need them. Without a target every
  endpoint scores 1.

Whether each target was met (the measured TTFT) is counted in
``epp_latency_target_requests_total{result}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epp import errors
from epp.errors import RequestError
from epp.request import InferenceRequest
from epp.scheduling.data import Input
from epp.scheduling.framework import Cycle, Filter, Scorer, register
from epp.scheduling.params import Params, param
from epp.scheduling.scorers.latency import LATENCY_TARGET, PREDICTED_LATENCY, Prediction
from epp.state.snapshot import EndpointState


@dataclass(frozen=True, slots=True)
class LatencyTargetParams(Params):
    ttft_ms: float = param(0.0, ge=0)
    on_miss: str = param("best", choices=("best", "refuse"))


@register("latency-target-filter")
class LatencyTargetFilter(Filter, Scorer):
    params_type = LatencyTargetParams
    consumes = (Input(PREDICTED_LATENCY), Input(LATENCY_TARGET, required=False))
    # After the filters that decide what may serve at all (LoRA, KV headroom).
    stage = 200

    def __init__(self, params: LatencyTargetParams = LatencyTargetParams()) -> None:
        self.default_target = params.ttft_ms / 1000 if params.ttft_ms else None
        self.refuse = params.on_miss == "refuse"

    def filter(
        self, request: InferenceRequest, candidates: list[EndpointState], cycle: Cycle
    ) -> list[EndpointState]:
        target = cycle.get(LATENCY_TARGET)
        predicted = cycle.get(PREDICTED_LATENCY) or {}
        if target is None or not predicted:
            return candidates
        meet = [c for c in candidates if _ttft(predicted, c) <= target]
        if meet or self.refuse:
            return meet
        return candidates

    def refusal(self, request: InferenceRequest, cycle: Cycle) -> RequestError | None:
        target = cycle.get(LATENCY_TARGET)
        return None if target is None else errors.target_unreachable(request.model, target)

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        target = cycle.get(LATENCY_TARGET)
        predicted = cycle.get(PREDICTED_LATENCY) or {}
        if target is None or not predicted:
            return [1.0] * len(candidates)
        out = []
        for c in candidates:
            ttft = _ttft(predicted, c)
            out.append(ttft / target if ttft <= target else 0.0)
        return out


def _ttft(predicted: Mapping[str, Prediction], endpoint: EndpointState) -> float:
    found = predicted.get(endpoint.address)
    return float("inf") if found is None else found.ttft
