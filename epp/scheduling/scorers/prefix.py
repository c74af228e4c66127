"""Prefer endpoints that already cache the request's prompt prefix (GIE's ``prefix-cache-scorer``).

A prompt prefix cached on a replica skips its prefill there, most of a long prompt's time to
first token. In the data step the plugin hashes the prompt into chained blocks
(:mod:`epp.prefix.hashing`) and asks the fleet's approximate index for its hashing parameters
(:func:`~epp.prefix.approximate.approx_prefix`: another ``block_chars`` or ``block_size`` is
another index) how many leading blocks each candidate caches; it publishes the result as
:data:`~epp.scheduling.prefix_data.APPROX_PREFIX` (blocks per endpoint, and cached prompt tokens,
which the TTFT scorer turns into uncached prefill work). The score is ``matched / total`` blocks.
After the pick it records the request's blocks for the chosen endpoint, so the next request with
that prefix (the next chat turn, a shared system prompt) goes back to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.prefix.approximate import DEFAULT_CAPACITY, approx_prefix
from epp.prefix.hashing import (
    DEFAULT_BLOCK_CHARS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_BLOCKS,
    BlockHasher,
)
from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, PostPick, Producer, Scorer, register
from epp.scheduling.params import Params, param
from epp.scheduling.prefix_data import APPROX_PREFIX, PrefixMatch
from epp.state.snapshot import EndpointState


@dataclass(frozen=True, slots=True)
class PrefixParams(Params):
    """``block_chars``/``block_size``: characters or token ids per hashed block;
    ``max_blocks``: leading blocks hashed; ``lru_capacity``: index size per endpoint, in blocks,
    used until the endpoint's scraped ``num_gpu_blocks`` gives its real KV capacity."""

    block_chars: int = param(DEFAULT_BLOCK_CHARS, ge=1)
    block_size: int = param(DEFAULT_BLOCK_SIZE, ge=1)
    max_blocks: int = param(DEFAULT_MAX_BLOCKS, ge=1)
    lru_capacity: int = param(DEFAULT_CAPACITY, ge=1)


@register("prefix-cache-scorer", "approx-prefix-cache-scorer")
class PrefixCacheScorer(Producer, Scorer, PostPick):
    """Score = cached leading blocks / hashed blocks; records each pick in the fleet's index."""

    params_type = PrefixParams
    produces = (APPROX_PREFIX,)

    def __init__(self, params: PrefixParams = PrefixParams()) -> None:
        self.hasher = BlockHasher(params.block_chars, params.block_size, params.max_blocks)
        self.lru_capacity = params.lru_capacity
        self.index = approx_prefix(self.hasher)
        self.states = (self.index,)

    def produce(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> None:
        hasher = self.hasher
        match = PrefixMatch(hasher, hasher.hashes(request), hasher.tokens_per_block(request))
        if match.hashes:
            found = cycle.fleet.states.get(self.index).match(
                match.hashes, [c.address for c in candidates]
            )
            match.blocks = found
            per_block = match.tokens_per_block
            match.cached_tokens = {e: n * per_block for e, n in found.items()}
        cycle.put(APPROX_PREFIX, match)

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        match = cycle.get(APPROX_PREFIX)
        if match is None:
            return [0.0] * len(candidates)
        return [match.fraction(c.address) for c in candidates]

    def on_pick(self, request: InferenceRequest, endpoint: EndpointState, cycle: Cycle) -> None:
        match = cycle.get(APPROX_PREFIX)
        if match is not None and match.hashes:
            capacity = self._capacity(endpoint, match.tokens_per_block)
            cycle.fleet.states.get(self.index).insert(endpoint.address, match.hashes, capacity)

    def _capacity(self, endpoint: EndpointState, tokens_per_block: int) -> int:
        """The endpoint's KV cache in index blocks: engine blocks x tokens / tokens per block."""
        metrics = endpoint.metrics
        if not metrics.num_gpu_blocks:
            return self.lru_capacity
        # Engine blocks and index blocks may differ in size (32-token engine blocks, 64-char
        # ~16-token index blocks): the cache holds the same number of tokens either way.
        engine_block = metrics.block_size or tokens_per_block
        return metrics.num_gpu_blocks * engine_block // tokens_per_block
