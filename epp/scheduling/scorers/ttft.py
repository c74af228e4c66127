"""Estimate each endpoint's time to first token for this request and prefer the fastest.

A request's first token waits for the prefill work queued ahead of it and then for its own
prefill, which covers only the prompt tokens the endpoint has not cached. Both are in tokens, so
the estimate is ``(outstanding work + uncached prompt tokens) / capacity``: cache affinity and
load are traded in one unit instead of through hand-tuned weights between separate scorers
(Dynamo's KV router costs workers the same way). Cached tokens come from the prefix scorers'
per-endpoint matches in ``cycle.data`` (precise when available, else approximate); without
either, every endpoint is assumed cold.

Score: ``(best + slack) / (estimate + slack)``, so the fastest endpoint scores 1 and one twice
as slow about 0.5; ``slack`` (a few blocks of work) keeps tiny differences from dominating.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, Scorer, register
from epp.scheduling.scorers.load import outstanding_tokens
from epp.state.snapshot import EndpointState

# Keys under which prefix scorers publish cached prompt tokens per endpoint, best source first.
CACHED_TOKEN_KEYS = ("cached_tokens", "approx_cached_tokens")


@register("ttft-scorer")
class TtftScorer(Scorer):
    def __init__(
        self, tokens_per_request: int = 512, slack_tokens: int = 64, queue_weight: float = 1.0
    ) -> None:
        if tokens_per_request <= 0 or slack_tokens <= 0 or queue_weight < 0:
            raise ValueError("tokens_per_request and slack_tokens must be > 0, queue_weight >= 0")
        self.tokens_per_request = tokens_per_request
        self.slack = slack_tokens
        # How much queued work counts against an endpoint relative to this request's own prefill.
        self.queue_weight = queue_weight

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        prompt = request.prompt_tokens()
        cached = _cached_tokens(cycle)
        estimates = []
        for c in candidates:
            uncached = max(0, prompt - cached.get(c.address, 0))
            queued = outstanding_tokens(c, cycle, self.tokens_per_request)
            capacity = cycle.weights.get(c.address, 1.0)
            estimates.append(self.queue_weight * queued + uncached / capacity)
        best = min(estimates)
        return [(best + self.slack) / (e + self.slack) for e in estimates]


def _cached_tokens(cycle: Cycle) -> Mapping[str, int]:
    for key in CACHED_TOKEN_KEYS:
        found = cycle.data.get(key)
        if found:
            return found
    return {}
