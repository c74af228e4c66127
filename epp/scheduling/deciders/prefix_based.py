"""Disaggregate a request when the decode replica would prefill many tokens itself
(llm-d's ``prefix-based-pd-decider`` and its ``nonCachedTokens``).

The decode replica is picked first, by the profile this decider is in. Moving a prompt's KV
costs a second hop and a transfer, which pays only when the decode replica would otherwise
compute many prompt tokens (a long prompt it does not cache): then its running decodes are not
stalled by that prefill. So the request is disaggregated when the prompt tokens minus those the
decode replica caches (the profile's prefix producer; without one the whole prompt counts)
reach ``non_cached_tokens`` (0: always).
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.request import InferenceRequest
from epp.scheduling.data import Input
from epp.scheduling.framework import Cycle, Decider, DeciderParams, register
from epp.scheduling.params import param
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.state.snapshot import EndpointState


@dataclass(frozen=True, slots=True)
class PrefixBasedParams(DeciderParams):
    """``non_cached_tokens``: the uncached prompt tokens from which a request is
    disaggregated (0: every request)."""

    non_cached_tokens: int = param(512, ge=0)


@register("prefix-based-pd-decider")
class PrefixBasedDecider(Decider):
    params_type = PrefixBasedParams
    consumes = (Input(CACHED_TOKENS, required=False),)

    def __init__(self, params: PrefixBasedParams = PrefixBasedParams()) -> None:
        super().__init__(params)
        self.threshold = params.non_cached_tokens

    def disaggregate(
        self, request: InferenceRequest, decode: EndpointState, uncached: int, cycle: Cycle
    ) -> bool:
        return uncached >= self.threshold
