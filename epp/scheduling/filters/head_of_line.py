"""Let cache affinity yield when the wait behind a replica's queue exceeds the prefill it saves.

A replica holding a popular prefix serves its requests without prefilling it, so every
affinity scorer sends them there; when a burst of them, or cold prefills of other prompts, are
queued there, the next request waits behind all of them while another replica could prefill it
from scratch sooner. Weighted scorers cannot see that trade: a full prefix match scores 1 however
long the queue in front of it. This filter predicts the request's time to first token on each
candidate by the learned latency model (:func:`~epp.scheduling.scorers.latency.predictions`:
the uncached prompt there, the prefill queued ahead and the decode batch, at the endpoint's
learned speeds) and drops the candidates predicted to be slower than the fastest by more than
``tolerance`` times its prediction plus ``slack_seconds``. The scorers then choose among the
rest as before, so a prefix stays on its replica until that replica's wait outgrows the prefill
a second replica would spend on it, and then the second replica (which caches it from then on)
takes the overflow: sticky until saturated.

The tolerance is the price of a cold prefill for the fleet: a request moved off its prefix
prefills again elsewhere, work every later request there waits behind, so a small predicted
gain is not worth it. Cached tokens are the data step's (precise beats approximate), read
here rather than in the data step because they are derived after every producer has run; a
profile without a prefix producer counts every prompt as uncached. No GIE equivalent; SGLang's
cache-aware router and llm-d's prefix routing spread a hot prefix on a load imbalance
threshold instead of on predicted time.
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.request import InferenceRequest
from epp.scheduling.data import Input
from epp.scheduling.framework import Cycle, Filter, register
from epp.scheduling.params import Params, param
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.scheduling.scorers.latency import predictions
from epp.state.snapshot import EndpointState


@dataclass(frozen=True, slots=True)
class HeadOfLineParams(Params):
    """``tolerance``: how much slower than the fastest candidate's predicted TTFT, as a share
    of it, a candidate may be predicted and stay; ``slack_seconds``: added to that bound, so
    that predictions of a few milliseconds apart (idle replicas, cache hits) keep every
    candidate."""

    tolerance: float = param(0.5, ge=0)
    slack_seconds: float = param(0.1, ge=0)


@register("head-of-line-filter")
class HeadOfLineFilter(Filter):
    params_type = HeadOfLineParams
    # After readiness, health, LoRA and KV headroom: the fastest is one that may serve.
    stage = 30
    consumes = (Input(CACHED_TOKENS, required=False),)

    def __init__(self, params: HeadOfLineParams = HeadOfLineParams()) -> None:
        self.tolerance = params.tolerance
        self.slack = params.slack_seconds

    def filter(
        self, request: InferenceRequest, candidates: list[EndpointState], cycle: Cycle
    ) -> list[EndpointState]:
        if len(candidates) < 2:
            return candidates
        predicted = predictions(request, candidates, cycle)
        times = [predicted[c.address].ttft for c in candidates]
        bound = min(times) * (1.0 + self.tolerance) + self.slack
        return [c for c, t in zip(candidates, times, strict=True) if t <= bound]
