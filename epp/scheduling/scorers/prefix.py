"""Prefer endpoints that already cache the request's prompt prefix (GIE's ``prefix-cache-scorer``).

A prompt prefix cached on a replica skips its prefill there: on the reference CPU vLLM a
500-token prompt's first token takes 38 ms cold and 12 ms on a full hit. The scorer hashes the
prompt into chained blocks (:mod:`epp.prefix.hashing`), asks the fleet's approximate index how
many leading blocks each candidate caches, and scores ``matched / total`` blocks. After the pick
it records the request's blocks for the chosen endpoint, so the next request with that prefix
(the next chat turn, a shared system prompt) goes back to it.

Hashes and matches are computed once per request and kept in ``cycle.data`` for every plugin:
``approx_prefix_match`` holds the :class:`PrefixMatch` (blocks and fraction per endpoint) and
``approx_cached_tokens`` the estimated cached prompt tokens per endpoint, which the TTFT scorer
turns into uncached prefill work. Plugins that read them must run after this scorer, or call
:func:`prefix_match` with the same hashing parameters (as the KV-headroom filter does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.prefix.approximate import DEFAULT_CAPACITY
from epp.prefix.hashing import (
    DEFAULT_BLOCK_CHARS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_BLOCKS,
    BlockHasher,
)
from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, PostPick, Scorer, register
from epp.state.snapshot import EndpointState

MATCH_KEY = "approx_prefix_match"
CACHED_TOKENS_KEY = "approx_cached_tokens"


@dataclass(slots=True)
class PrefixMatch:
    """One request's block hashes and, per endpoint, its approximately cached leading blocks."""

    hasher: BlockHasher
    hashes: list[int]
    tokens_per_block: int
    blocks: dict[str, int] = field(default_factory=dict)
    # Same keys as ``blocks``, in prompt tokens; the object published as ``approx_cached_tokens``.
    cached_tokens: dict[str, int] = field(default_factory=dict)

    def fraction(self, endpoint: str) -> float:
        """Share of the hashed blocks cached on ``endpoint`` (0 when nothing was hashed)."""
        return self.blocks.get(endpoint, 0) / len(self.hashes) if self.hashes else 0.0


def prefix_match(
    request: InferenceRequest,
    candidates: Sequence[EndpointState],
    cycle: Cycle,
    hasher: BlockHasher,
) -> PrefixMatch:
    """The request's :class:`PrefixMatch`, covering at least ``candidates``; computed once.

    Hashes are computed on the first call of a cycle; each endpoint is matched the first time it
    is asked about, so a filter and a scorer that see different candidate lists share the work.
    """
    match: PrefixMatch | None = cycle.data.get(MATCH_KEY)
    if match is None or match.hasher != hasher:
        match = PrefixMatch(hasher, hasher.hashes(request), hasher.tokens_per_block(request))
        cycle.data[MATCH_KEY] = match
        cycle.data[CACHED_TOKENS_KEY] = match.cached_tokens
    missing = [c.address for c in candidates if c.address not in match.blocks]
    if missing:
        found = cycle.fleet.prefix.match(match.hashes, missing)
        match.blocks.update(found)
        per_block = match.tokens_per_block
        match.cached_tokens.update((e, n * per_block) for e, n in found.items())
    return match


@register("prefix-cache-scorer", "approx-prefix-cache-scorer")
class PrefixCacheScorer(Scorer, PostPick):
    """Score = cached leading blocks / hashed blocks; records each pick in the fleet's index.

    ``lru_capacity`` is the index size per endpoint, in blocks, used until the endpoint's
    scraped ``num_gpu_blocks`` gives its real KV capacity.
    """

    def __init__(
        self,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        lru_capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self.hasher = BlockHasher(block_chars, block_size, max_blocks)
        if lru_capacity <= 0:
            raise ValueError("lru_capacity must be > 0")
        self.lru_capacity = lru_capacity

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        match = prefix_match(request, candidates, cycle, self.hasher)
        return [match.fraction(c.address) for c in candidates]

    def on_pick(self, request: InferenceRequest, endpoint: EndpointState, cycle: Cycle) -> None:
        match = prefix_match(request, (), cycle, self.hasher)
        if match.hashes:
            capacity = self._capacity(endpoint, match.tokens_per_block)
            cycle.fleet.prefix.insert(endpoint.address, match.hashes, capacity)

    def _capacity(self, endpoint: EndpointState, tokens_per_block: int) -> int:
        """The endpoint's KV cache in index blocks: engine blocks x tokens / tokens per block."""
        metrics = endpoint.metrics
        if not metrics.num_gpu_blocks:
            return self.lru_capacity
        # Engine blocks and index blocks may differ in size (32-token engine blocks, 64-char
        # ~16-token index blocks): the cache holds the same number of tokens either way.
        engine_block = metrics.block_size or tokens_per_block
        return metrics.num_gpu_blocks * engine_block // tokens_per_block
