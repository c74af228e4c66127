"""Latency targets: send a request only where it is predicted to meet its TTFT and TPOT targets.

A request's targets, each kind on its own, come from the ``x-llm-d-slo-ttft-ms`` /
``x-llm-d-slo-tpot-ms`` headers (llm-d's names) when the configuration trusts whoever sets
them (``request.trusted_headers``, or an authorization service allowed to set them; the
rendered Envoy strips client copies otherwise, docs/identity.md), else from its objective
(``request.objectives.NAME.ttft_ms`` / ``tpot_ms``), else from this plugin's ``ttft_ms`` /
``tpot_ms`` (the profile's defaults; 0: none). The router puts them in the cycle
(:data:`LATENCY_TARGET`). The predictions are the
``predicted-latency-scorer``'s (:data:`~epp.scheduling.scorers.latency.PREDICTED_LATENCY`),
a required input.

- Filter: keeps the endpoints predicted to meet every target. When none is, ``on_miss:
  best`` keeps them all (the other scorers, the latency scorer among them, pick the least bad)
  and ``on_miss: refuse`` answers 429 ``latency_target_unreachable`` rather than send the
  request to miss its target.
- Scorer: among those that meet them, the one with the least headroom wasted scores highest
  (the tightest of predicted / target): a request with a loose target goes to an endpoint that
  just makes it, leaving the fast, idle ones to requests that need them. Without a target
  every endpoint scores 1.

Whether each target was met (the measured TTFT at the first token, the measured TPOT at the
end) is counted in ``epp_latency_target_requests_total{objective, target, result}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epp import errors
from epp.errors import RequestError
from epp.request import InferenceRequest, LatencyTarget
from epp.scheduling.data import LATENCY_TARGET, Input
from epp.scheduling.framework import Cycle, Filter, Scorer, register
from epp.scheduling.params import Params, param
from epp.scheduling.scorers.latency import PREDICTED_LATENCY, Prediction
from epp.state.snapshot import EndpointState


@dataclass(frozen=True, slots=True)
class LatencyTargetParams(Params):
    ttft_ms: float = param(0.0, ge=0)
    tpot_ms: float = param(0.0, ge=0)
    on_miss: str = param("best", choices=("best", "refuse"))


@register("latency-target-filter")
class LatencyTargetFilter(Filter, Scorer):
    params_type = LatencyTargetParams
    consumes = (Input(PREDICTED_LATENCY), Input(LATENCY_TARGET, required=False))
    # After the filters that decide what may serve at all (LoRA, KV headroom).
    stage = 200

    def __init__(self, params: LatencyTargetParams = LatencyTargetParams()) -> None:
        self.default_target = LatencyTarget(
            params.ttft_ms / 1000 if params.ttft_ms else None,
            params.tpot_ms / 1000 if params.tpot_ms else None,
        )
        self.refuse = params.on_miss == "refuse"

    def filter(
        self, request: InferenceRequest, candidates: list[EndpointState], cycle: Cycle
    ) -> list[EndpointState]:
        target = cycle.get(LATENCY_TARGET)
        predicted = cycle.get(PREDICTED_LATENCY) or {}
        if target is None or not predicted:
            return candidates
        meet = [c for c in candidates if _met(target, predicted, c)]
        if meet or self.refuse:
            return meet
        return candidates

    def refusal(self, request: InferenceRequest, cycle: Cycle) -> RequestError | None:
        target = cycle.get(LATENCY_TARGET)
        if target is None:
            return None
        return errors.target_unreachable(request.model, target.ttft, target.tpot)

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        target = cycle.get(LATENCY_TARGET)
        predicted = cycle.get(PREDICTED_LATENCY) or {}
        if target is None or not predicted:
            return [1.0] * len(candidates)
        out = []
        for c in candidates:
            p = predicted.get(c.address)
            met = p is not None and target.met(p.ttft, p.tpot)
            out.append(target.headroom_used(p.ttft, p.tpot) if p is not None and met else 0.0)
        return out


def _met(
    target: LatencyTarget, predicted: Mapping[str, Prediction], endpoint: EndpointState
) -> bool:
    found = predicted.get(endpoint.address)
    return found is not None and target.met(found.ttft, found.tpot)
