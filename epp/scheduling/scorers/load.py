"""Prefer endpoints with less outstanding work, counted the moment epp routes it.

Scraped queue depth is up to one scrape interval old: a burst that arrives between two scrapes
would see every replica as it was and pile onto the one that looked idlest. This scorer reads
epp's own in-flight tokens (uncached prompt plus requested output, added at each pick, released
when the request's stream ends; summed over every epp process when state is shared) and, for
work epp did not route (other gateways, requests still queued from before a restart), the
scraped queue. The larger of the two is the endpoint's load, divided by its capacity weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, Scorer, register
from epp.scheduling.params import Params, param
from epp.state.inflight import Load
from epp.state.snapshot import EndpointState


def outstanding_tokens(
    endpoint: EndpointState, own: Load, weights: Mapping[str, float], tokens_per_request: int
) -> float:
    """Work ahead of a new request on ``endpoint``, in tokens, per unit of capacity (its
    ``weights`` entry); ``own``: epp's in-flight load there.

    Scraped requests are converted to tokens at the size of the requests epp has in flight
    there (``tokens_per_request`` when it has none): a fixed guess would make a replica busy
    with a few short requests look heavier than epp's own count of long ones, or the reverse.
    """
    metrics = endpoint.metrics
    per_request = own.tokens / own.requests if own.requests else tokens_per_request
    scraped = (metrics.waiting + metrics.running) * per_request
    return max(own.tokens, scraped) / weights.get(endpoint.address, 1.0)


@dataclass(frozen=True, slots=True)
class InflightLoadParams(Params):
    tokens_per_request: int = param(512, ge=1)
    normalise: str = param("ratio", choices=("ratio", "min-max"))


@register("inflight-load-scorer", "active-request-scorer")
class InflightLoadScorer(Scorer):
    """Score in [0, 1]: 1 for the least loaded candidate, less for the others.

    ``normalise`` says how much less. ``ratio`` (the default): ``(least + slack) / (load +
    slack)``, so loads that differ by little score alike: an idle replica and one with a cold
    request in flight are far apart, while ten busy replicas within 10% of each other all score
    about 1 and leave the decision to cache affinity (a miss under overload is extra work for
    the whole fleet). ``min-max`` (GIE's normalisation): the least loaded 1, the most loaded 0,
    linear between, however small the spread. ``tokens_per_request`` converts scraped request
    counts to tokens when epp has no count of its own for them, and is the ``slack``.
    """

    params_type = InflightLoadParams

    def __init__(self, params: InflightLoadParams = InflightLoadParams()) -> None:
        self.tokens_per_request = params.tokens_per_request
        self.normalise = params.normalise

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        load = cycle.fleet.inflight.load
        weights = cycle.weights
        default = self.tokens_per_request
        loads = [outstanding_tokens(c, load(c.address), weights, default) for c in candidates]
        low, high = min(loads), max(loads)
        if self.normalise == "ratio":
            slack = self.tokens_per_request
            return [(low + slack) / (load + slack) for load in loads]
        if high == low:
            return [1.0] * len(loads)
        return [(high - load) / (high - low) for load in loads]
