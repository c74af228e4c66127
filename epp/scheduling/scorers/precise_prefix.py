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

Per request, the plugin publishes in ``cycle.data``: ``prompt_token_ids`` (the engine's ids)
and ``cached_tokens`` (endpoint -> prompt tokens the engine will not recompute: whole matched
blocks, capped at ``prompt length - 1`` as vLLM caps a hit), which the TTFT scorer prefers over
the approximate scorer's ``approx_cached_tokens``; list this scorer before it. Both are absent
when the prompt's tokens are not known (no tokenizer configured for the model, a chat template
that fails, a long prompt whose tokenizing outlasts ``tokenize_wait``): every endpoint then
scores 0 here and readers fall back to the approximate estimate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.prefix.precise import chain_keys, root_key
from epp.prefix.tokens import DEFAULT_MAX_INLINE_CHARS
from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, PostPick, Prepare, Scorer, register
from epp.state.fleet import FleetState
from epp.state.snapshot import EndpointState

log = logging.getLogger(__name__)

MATCH_KEY = "precise_prefix_match"
CACHED_TOKENS_KEY = "cached_tokens"
TOKEN_IDS_KEY = "prompt_token_ids"
DEFAULT_SPECULATIVE_TTL = 2.0
# Tokenizing a 32k-token prompt takes ~45 ms here; its prefill, cold, takes seconds on a GPU.
DEFAULT_TOKENIZE_WAIT = 0.1
# 64k tokens in 16-token blocks: keying costs ~0.3 us per block, matching beyond rarely decides.
DEFAULT_MAX_BLOCKS = 4096


@dataclass(slots=True)
class PreciseMatch:
    """One request's engine tokens and, per endpoint, its engine-cached leading blocks."""

    tokens: Sequence[int] | None
    lora: str | None
    max_blocks: int
    # Block size -> keys of the prompt's leading full blocks.
    keys: dict[int, list[int]] = field(default_factory=dict)
    blocks: dict[str, int] = field(default_factory=dict)
    block_sizes: dict[str, int] = field(default_factory=dict)
    # Published as ``cached_tokens``.
    cached_tokens: dict[str, int] = field(default_factory=dict)

    def keys_for(self, block_size: int) -> list[int]:
        keys = self.keys.get(block_size)
        if keys is None:
            tokens = self.tokens or ()
            try:
                keys = chain_keys(
                    tokens[: self.max_blocks * block_size], block_size, root_key(self.lora)
                )
            except OverflowError:
                keys = []  # ids outside 0..2**32-1: no engine caches them
            self.keys[block_size] = keys
        return keys

    def fraction(self, endpoint: str) -> float:
        size = self.block_sizes.get(endpoint)
        keys = self.keys.get(size, []) if size else []
        return self.blocks.get(endpoint, 0) / len(keys) if keys else 0.0


@register("precise-prefix-cache-scorer")
class PrecisePrefixCacheScorer(Scorer, PostPick, Prepare):
    """Score = engine-cached leading blocks / full blocks; speculative entries after a pick.

    ``max_inline_chars``: longest uncached stretch of prompt text tokenized on the request
    path (~0.5 us per character here); longer ones are tokenized in a worker thread while the
    request waits up to ``tokenize_wait`` seconds before scheduling (other requests go on
    meanwhile); past that it is scored without precise ids and the next request with that
    prompt finds them. ``speculative_ttl`` 0 disables speculative entries.
    """

    def __init__(
        self,
        speculative_ttl: float = DEFAULT_SPECULATIVE_TTL,
        max_inline_chars: int = DEFAULT_MAX_INLINE_CHARS,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        tokenize_wait: float = DEFAULT_TOKENIZE_WAIT,
    ) -> None:
        if speculative_ttl < 0 or max_inline_chars < 0 or max_blocks <= 0 or tokenize_wait < 0:
            raise ValueError(
                "speculative_ttl, max_inline_chars and tokenize_wait must be >= 0, max_blocks > 0"
            )
        self.speculative_ttl = speculative_ttl
        self.max_inline_chars = max_inline_chars
        self.max_blocks = max_blocks
        self.tokenize_wait = tokenize_wait

    async def prepare(self, request: InferenceRequest, fleet: FleetState) -> None:
        if self.tokenize_wait <= 0:
            return
        try:
            async with asyncio.timeout(self.tokenize_wait):
                await fleet.tokenizers.wait_for(request, self.max_inline_chars)
        except TimeoutError:
            log.debug(
                "request %s: no precise ids within %ss", request.request_id, self.tokenize_wait
            )

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        match = self._match(request, candidates, cycle)
        return [match.fraction(c.address) for c in candidates]

    def on_pick(self, request: InferenceRequest, endpoint: EndpointState, cycle: Cycle) -> None:
        match: PreciseMatch | None = cycle.data.get(MATCH_KEY)
        if match is None or match.tokens is None or self.speculative_ttl <= 0:
            return
        index = cycle.fleet.precise
        size = match.block_sizes.get(endpoint.address)
        if size is None:
            return  # block size unknown: nothing was matched, nothing can be keyed
        # Blocks already matched are cached (or already speculated): only the rest is new.
        new = match.keys_for(size)[match.blocks.get(endpoint.address, 0) :]
        index.expire(cycle.now)
        if new:
            index.add_speculative(endpoint.address, new, cycle.now + self.speculative_ttl)

    def _match(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> PreciseMatch:
        match: PreciseMatch | None = cycle.data.get(MATCH_KEY)
        if match is None:
            tokens = cycle.fleet.tokenizers.token_ids(request, self.max_inline_chars)
            match = PreciseMatch(tokens, request.lora, self.max_blocks)
            cycle.data[MATCH_KEY] = match
            if tokens is not None:
                cycle.data[TOKEN_IDS_KEY] = tokens
                cycle.data[CACHED_TOKENS_KEY] = match.cached_tokens
        if match.tokens is None:
            return match
        index = cycle.fleet.precise
        by_size: dict[int, list[str]] = {}
        for c in candidates:
            if c.address in match.blocks:
                continue
            size = c.metrics.block_size or index.block_size(c.address)
            if size:
                by_size.setdefault(size, []).append(c.address)
        prompt = len(match.tokens)
        for size, addresses in by_size.items():
            # vLLM recomputes at least the prompt's last token, so a hit stops a block short
            # when the prompt is exactly whole blocks.
            usable = (prompt - 1) // size
            for address, blocks in index.match(match.keys_for(size), addresses, cycle.now).items():
                match.blocks[address] = blocks
                match.block_sizes[address] = size
                match.cached_tokens[address] = min(blocks, usable) * size
        return match
