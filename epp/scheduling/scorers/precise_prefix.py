"""Prefer endpoints whose engine reports caching the request's prompt prefix (llm-d's precise
prefix scorer, ``precise-prefix-cache-scorer``).

Where the approximate scorer remembers where epp sent prompts, this one knows what each vLLM
engine actually caches, from its KV events (:mod:`epp.sources.kv_events` feeding
:class:`~epp.prefix.precise.PreciseIndex`): evictions, restarts and other routers' traffic are
all seen. The prompt is tokenized as the engine tokenizes it (:mod:`epp.prefix.tokens`), cut
into the endpoint's own block size (scraped ``cache_config_info``, else what its events say),
and keyed like the index; the score is ``matched leading blocks / full blocks``.

After the pick, the request's blocks count as cached on the chosen endpoint for
``speculative_ttl`` seconds (until the engine's own event confirms them), so requests that
arrive before the prefill has run follow the first one.

In the data step the plugin publishes :data:`~epp.scheduling.prefix_data.PRECISE_PREFIX`: the
engine's token ids and, per endpoint, the prompt tokens the engine will not recompute (whole
matched blocks, capped at ``prompt length - 1`` as vLLM caps a hit), which
:data:`~epp.scheduling.prefix_data.CACHED_TOKENS` prefers over the approximate count. When the
prompt's tokens are not known (no tokenizer configured for the model, a chat template that
fails, a long prompt whose tokenizing outlasts ``tokenize_wait``) nothing matches: every
endpoint scores 0 here and readers fall back to the approximate estimate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from epp.prefix.precise import PRECISE_INDEX, TOKENIZERS
from epp.prefix.tokens import DEFAULT_MAX_INLINE_CHARS
from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, PostPick, Prepare, Producer, Scorer, register
from epp.scheduling.params import Params, param
from epp.scheduling.prefix_data import PRECISE_PREFIX, PreciseMatch
from epp.state.fleet import FleetState
from epp.state.snapshot import EndpointState

log = logging.getLogger(__name__)

DEFAULT_SPECULATIVE_TTL = 2.0
# Long enough to tokenize a long prompt; short against what its cold prefill costs on a GPU.
DEFAULT_TOKENIZE_WAIT = 0.1
# 64k tokens in 16-token blocks: keying is linear in the blocks, matching beyond rarely decides.
DEFAULT_MAX_BLOCKS = 4096


@dataclass(frozen=True, slots=True)
class PreciseParams(Params):
    """``max_inline_chars``: longest uncached stretch of prompt text tokenized on the request
    path (tokenizing holds the event loop, for longer the longer the text); longer ones are
    tokenized in a worker thread while the
    request waits up to ``tokenize_wait`` seconds before scheduling (other requests go on
    meanwhile); past that it is scored without precise ids and the next request with that
    prompt finds them. ``speculative_ttl`` 0 disables speculative entries."""

    speculative_ttl: float = param(DEFAULT_SPECULATIVE_TTL, ge=0)
    max_inline_chars: int = param(DEFAULT_MAX_INLINE_CHARS, ge=0)
    max_blocks: int = param(DEFAULT_MAX_BLOCKS, ge=1)
    tokenize_wait: float = param(DEFAULT_TOKENIZE_WAIT, ge=0)


@register("precise-prefix-cache-scorer")
class PrecisePrefixCacheScorer(Producer, Scorer, PostPick, Prepare):
    """Score = engine-cached leading blocks / full blocks; speculative entries after a pick."""

    params_type = PreciseParams
    produces = (PRECISE_PREFIX,)
    states = (PRECISE_INDEX, TOKENIZERS)

    def __init__(self, params: PreciseParams = PreciseParams()) -> None:
        self.speculative_ttl = params.speculative_ttl
        self.max_inline_chars = params.max_inline_chars
        self.max_blocks = params.max_blocks
        self.tokenize_wait = params.tokenize_wait

    async def prepare(self, request: InferenceRequest, fleet: FleetState) -> None:
        if self.tokenize_wait <= 0:
            return
        try:
            async with asyncio.timeout(self.tokenize_wait):
                await fleet.states.get(TOKENIZERS).wait_for(request, self.max_inline_chars)
        except TimeoutError:
            log.debug(
                "request %s: no precise ids within %ss", request.request_id, self.tokenize_wait
            )

    def produce(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> None:
        tokens = cycle.fleet.states.get(TOKENIZERS).token_ids(request, self.max_inline_chars)
        match = PreciseMatch(tokens, request.lora, self.max_blocks)
        cycle.put(PRECISE_PREFIX, match)
        if tokens is None:
            return
        index = cycle.fleet.states.get(PRECISE_INDEX)
        by_size: dict[int, list[str]] = {}
        for c in candidates:
            size = c.metrics.block_size or index.block_size(c.address)
            if size:
                by_size.setdefault(size, []).append(c.address)
        prompt = len(tokens)
        for size, addresses in by_size.items():
            # vLLM recomputes at least the prompt's last token, so a hit stops a block short
            # when the prompt is exactly whole blocks.
            usable = (prompt - 1) // size
            for address, blocks in index.match(match.keys_for(size), addresses, cycle.now).items():
                match.blocks[address] = blocks
                match.block_sizes[address] = size
                match.cached_tokens[address] = min(blocks, usable) * size

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        match = cycle.get(PRECISE_PREFIX)
        if match is None:
            return [0.0] * len(candidates)
        return [match.fraction(c.address) for c in candidates]

    def on_pick(self, request: InferenceRequest, endpoint: EndpointState, cycle: Cycle) -> None:
        match = cycle.get(PRECISE_PREFIX)
        if match is None or match.tokens is None or self.speculative_ttl <= 0:
            return
        index = cycle.fleet.states.get(PRECISE_INDEX)
        size = match.block_sizes.get(endpoint.address)
        if size is None:
            return  # block size unknown: nothing was matched, nothing can be keyed
        # Blocks already matched are cached (or already speculated): only the rest is new.
        new = match.keys_for(size)[match.blocks.get(endpoint.address, 0) :]
        index.expire(cycle.now)
        if new:
            index.add_speculative(endpoint.address, new, cycle.now + self.speculative_ttl)
