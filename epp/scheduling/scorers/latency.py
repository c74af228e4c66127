"""Prefer the endpoint predicted to serve this request fastest, by the learned latency model.

For every candidate the scorer predicts this request's time to first token from its uncached
prompt tokens there (the prefix producers' matches, :data:`~epp.scheduling.prefix_data.
CACHED_TOKENS`; without a prefix producer every endpoint is assumed cold), the prefill queued
ahead of it and the decode batch (epp's own in-flight work, floored by the scraped queue), and
the endpoint's learned rates (:mod:`epp.state.latency`); and its time per output token from
the batch it would join. No capacity weight is needed: a replica twice as fast is predicted
twice as fast once it has served a few requests (a configured ``weight`` only sets what is
assumed before then).

It also produces the predictions (:data:`PREDICTED_LATENCY`), for plugins that compare them
with a latency target.

Score: ``(best + slack) / (cost + slack)`` where ``cost`` is the predicted TTFT plus
``tpot_weight`` times the predicted decode time (output tokens x TPOT): 1 for the fastest,
about 0.5 for one twice as slow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epp.request import InferenceRequest
from epp.scheduling.data import DataKey, Input
from epp.scheduling.framework import Cycle, Producer, Scorer, register
from epp.scheduling.params import Params, param
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.state.snapshot import EndpointState


@dataclass(frozen=True, slots=True)
class Prediction:
    """One request on one endpoint: seconds to its first token, seconds per output token."""

    ttft: float
    tpot: float


PREDICTED_LATENCY: DataKey[Mapping[str, Prediction]] = DataKey(
    "predicted TTFT and TPOT per endpoint"
)


def predictions(
    request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
) -> dict[str, Prediction]:
    """``request``'s predicted latency on each candidate by the learned model: its uncached
    prompt there (the cycle's cached tokens; none known: all of it), the prefill queued ahead
    and the decode batch (epp's in-flight work, floored by the scraped queue)."""
    prompt = request.prompt_tokens()
    cached = cycle.get(CACHED_TOKENS) or {}
    model = cycle.fleet.latency
    inflight = cycle.fleet.inflight
    now = cycle.now
    out = {}
    for c in candidates:
        address = c.address
        uncached = max(0, prompt - cached.get(address, 0))
        out[address] = Prediction(*model.predict(uncached, inflight.load(address), c, now))
    return out


@dataclass(frozen=True, slots=True)
class PredictedLatencyParams(Params):
    """``tpot_weight``: how much the predicted decode time (output tokens x TPOT) counts
    next to the predicted TTFT (0: TTFT alone, 1: the whole response). ``slack_seconds``
    keeps tiny differences between fast endpoints from dominating the score."""

    tpot_weight: float = param(0.0, ge=0)
    slack_seconds: float = param(0.05, gt=0)


@register("predicted-latency-scorer")
class PredictedLatencyScorer(Producer, Scorer):
    params_type = PredictedLatencyParams
    produces = (PREDICTED_LATENCY,)
    consumes = (Input(CACHED_TOKENS, required=False),)

    def __init__(self, params: PredictedLatencyParams = PredictedLatencyParams()) -> None:
        self.tpot_weight = params.tpot_weight
        self.slack = params.slack_seconds

    def produce(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> None:
        cycle.put(PREDICTED_LATENCY, predictions(request, candidates, cycle))

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        predicted = cycle.get(PREDICTED_LATENCY) or {}
        decode = self.tpot_weight * request.output_tokens()
        costs = []
        for c in candidates:
            p = predicted.get(c.address)
            costs.append(0.0 if p is None else p.ttft + decode * p.tpot)
        best = min(costs)
        return [(best + self.slack) / (cost + self.slack) for cost in costs]
