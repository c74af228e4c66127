"""What the prefix producers compute per request, and the one rule that combines them.

``prefix-cache-scorer`` produces :data:`APPROX_PREFIX` (epp's memory of where it sent each
prompt's blocks), ``precise-prefix-cache-scorer`` produces :data:`PRECISE_PREFIX` (what the
engines report caching, keyed by their own token ids). Plugins that need to know how much of the
prompt an endpoint would not recompute read :data:`CACHED_TOKENS`, derived from whichever of the
two the profile has: precise beats approximate (:func:`best_cached_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from epp.prefix.hashing import BlockHasher
from epp.prefix.precise import chain_keys, root_key
from epp.scheduling.data import DataKey, Derived, derive
from epp.scheduling.framework import Cycle


@dataclass(slots=True)
class PrefixMatch:
    """One request's block hashes and, per endpoint, its approximately cached leading blocks."""

    hasher: BlockHasher
    hashes: list[int]
    tokens_per_block: int
    blocks: dict[str, int] = field(default_factory=dict)
    # Same keys as ``blocks``, in prompt tokens.
    cached_tokens: dict[str, int] = field(default_factory=dict)

    def fraction(self, endpoint: str) -> float:
        """Share of the hashed blocks cached on ``endpoint`` (0 when nothing was hashed)."""
        return self.blocks.get(endpoint, 0) / len(self.hashes) if self.hashes else 0.0


@dataclass(slots=True)
class PreciseMatch:
    """One request's engine tokens and, per endpoint, its engine-cached leading blocks.

    ``tokens`` is None when the prompt's engine ids are not known (no tokenizer for the model,
    a failing chat template, a long prompt still being tokenized): nothing matches then.
    """

    tokens: Sequence[int] | None
    lora: str | None
    max_blocks: int
    # Block size -> keys of the prompt's leading full blocks.
    keys: dict[int, list[int]] = field(default_factory=dict)
    blocks: dict[str, int] = field(default_factory=dict)
    block_sizes: dict[str, int] = field(default_factory=dict)
    # Prompt tokens the engine will not recompute: whole matched blocks, capped at
    # ``prompt length - 1`` as vLLM caps a hit.
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


APPROX_PREFIX: DataKey[PrefixMatch] = DataKey("approximate prefix matches")
PRECISE_PREFIX: DataKey[PreciseMatch] = DataKey("engine-reported (precise) prefix matches")
CACHED_TOKENS: DataKey[Mapping[str, int]] = DataKey("cached prompt tokens per endpoint")


def best_cached_tokens(cycle: Cycle) -> Mapping[str, int]:
    """Prompt tokens each endpoint caches for this request: precise beats approximate.

    The engines' own reports see evictions, restarts and other routers' traffic; epp's memory of
    its picks is a guess. The approximate count is used only when the precise one is absent
    (no precise producer in the profile, or the prompt's engine ids are not known).
    """
    precise = cycle.get(PRECISE_PREFIX)
    if precise is not None and precise.cached_tokens:
        return precise.cached_tokens
    approx = cycle.get(APPROX_PREFIX)
    return approx.cached_tokens if approx is not None else {}


derive(Derived(CACHED_TOKENS, (PRECISE_PREFIX, APPROX_PREFIX), best_cached_tokens))
