"""Spread prompts that no endpoint has cached, least recently given one first.

A prompt cached nowhere (a new prefix group's first request, a new conversation) founds a cache
wherever it lands, and the requests that share it follow it there. Cache affinity cannot place
it, and load places it by the queue of the moment, so one replica can collect more prefix groups
than its KV cache holds while another holds few: the first keeps evicting its groups' prefixes
and recomputing them, which is where an affinity router's misses come from. Spreading the
founders over the endpoints in turn keeps the groups per replica even. llm-d's
no-hit-LRU scorer and SGLang's cache-aware policy (the smallest tree on a miss) do the same job.

A request counts as cold when no candidate caches ``cold_below`` of its prompt (the prefix
producers' :data:`~epp.scheduling.prefix_data.CACHED_TOKENS`; without a prefix producer every
request is cold). Cold: the candidate that received a cold prompt longest ago (or never) scores
1, the most recent 0, linearly by rank between. Warm: every candidate scores 1, so cache
affinity and load decide. Memory: :class:`~epp.state.cold_picks.ColdPicks`, kept in the fleet
state (:data:`COLD_PICKS`) so that a reload does not forget it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.request import InferenceRequest
from epp.scheduling.data import Input
from epp.scheduling.framework import Cycle, PostPick, Scorer, register
from epp.scheduling.params import Params, param
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.state.cold_picks import ColdPicks
from epp.state.registry import StateKey
from epp.state.snapshot import EndpointState

# Per process, unkeyed (an endpoint's place in line means the same whatever ``cold_below``),
# and left where a retry found it: the order spreads prompts, it does not claim a cache.
COLD_PICKS = StateKey("cold-picks", ColdPicks)


@dataclass(frozen=True, slots=True)
class NoHitLruParams(Params):
    """``cold_below``: the share of the prompt the best-caching candidate must hold for the
    request to count as warm (SGLang's cache-aware policy uses 0.3 of the characters)."""

    cold_below: float = param(0.3, gt=0, le=1)


@register("no-hit-lru-scorer")
class NoHitLruScorer(Scorer, PostPick):
    params_type = NoHitLruParams
    consumes = (Input(CACHED_TOKENS, required=False),)
    states = (COLD_PICKS,)

    def __init__(self, params: NoHitLruParams = NoHitLruParams()) -> None:
        self.cold_below = params.cold_below

    def cold(self, request: InferenceRequest, cycle: Cycle) -> bool:
        cached = cycle.get(CACHED_TOKENS)
        best = max(cached.values(), default=0) if cached else 0
        return best < self.cold_below * request.prompt_tokens()

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        if len(candidates) < 2 or not self.cold(request, cycle):
            return [1.0] * len(candidates)
        ranks = cycle.fleet.states.get(COLD_PICKS).ranks([c.address for c in candidates])
        last = len(candidates) - 1
        return [(last - rank) / last for rank in ranks]

    def on_pick(self, request: InferenceRequest, endpoint: EndpointState, cycle: Cycle) -> None:
        if self.cold(request, cycle):
            cycle.fleet.states.get(COLD_PICKS).record(endpoint.address)
