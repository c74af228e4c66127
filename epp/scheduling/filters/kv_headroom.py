"""Keep a long prompt away from replicas whose KV cache has no room for it.

A replica that cannot fit a prompt's KV blocks queues it, or preempts running requests to make
room, while another replica could start it at once. The filter estimates the blocks the request
needs on each endpoint, its prompt tokens minus those cached there, in the endpoint's
``block_size``, and compares them with the endpoint's free blocks, ``(1 - kv_usage) *
(num_gpu_blocks - 1)`` (vLLM reserves one null block). Endpoints that cannot fit the prompt are
dropped, unless none can (the engine queues it then; refusing would be worse). Endpoints whose
cache geometry is not known yet are kept.

Only the prompt is counted: output grows one block per ``block_size`` tokens and the engine
preempts to make room later, which is what the load scorers weigh. Cached tokens are the
profile's :data:`~epp.scheduling.prefix_data.CACHED_TOKENS`, so a profile with this filter must
have a prefix producer (``prefix-cache-scorer``, weight 0 if it should not score). No GIE
equivalent.
"""

from __future__ import annotations

import math

from epp.request import InferenceRequest
from epp.scheduling.data import Input
from epp.scheduling.framework import Cycle, Filter, register
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.state.snapshot import EndpointMetrics, EndpointState


@register("kv-headroom-filter")
class KvHeadroomFilter(Filter):
    stage = 20
    consumes = (Input(CACHED_TOKENS),)

    def filter(
        self, request: InferenceRequest, candidates: list[EndpointState], cycle: Cycle
    ) -> list[EndpointState]:
        prompt = request.prompt_tokens()
        room = [_free_tokens(c.metrics) for c in candidates]
        # Most prompts fit everywhere even uncached: decided without reading matches.
        if prompt <= min(room, default=math.inf):
            return candidates
        cached = cycle.get(CACHED_TOKENS) or {}
        fits = zip(candidates, room, strict=True)
        kept = [c for c, free in fits if prompt - cached.get(c.address, 0) <= free]
        return kept or candidates


def _free_tokens(metrics: EndpointMetrics) -> float:
    """Tokens the endpoint's free KV blocks hold (infinite while its cache geometry is unknown).

    ``tokens <= free_blocks * block_size`` is the same test as ``ceil(tokens / block_size) <=
    free_blocks``: a partly filled last block takes a whole block.
    """
    usable = metrics.usable_kv_blocks
    if usable is None or metrics.block_size is None:
        return math.inf
    # Rounding recovers the integer count of free blocks from the usage ratio.
    free_blocks = round((1.0 - metrics.kv_usage) * usable)
    return free_blocks * metrics.block_size
