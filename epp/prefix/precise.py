"""Which endpoint caches which prompt blocks, as the engines themselves report it (KV events).

vLLM publishes a ``BlockStored`` event with the token ids of every block it caches and a
``BlockRemoved`` for every block it evicts (see :mod:`epp.sources.kv_events`). Engine block
hashes cannot be recomputed here in general (they depend on the engine's hash algorithm, its
seed and, for LoRA, the adapter's path on the server), so the index re-keys every block with a
hash of our own, chained over the same token ids: ``key_i = xxh3(block i's tokens, key_{i-1})``
where ``key_{-1}`` is the key of the block's parent (found through the engine hash the event
names) or, for a first block, a root derived from the LoRA adapter. A request tokenized the way
the engine tokenizes it (:mod:`epp.prefix.tokens`) gets the same keys from :func:`chain_keys`,
and its longest run of leading keys present on an endpoint is the prefix that endpoint will not
recompute (llm-d's precise prefix scorer works the same way).

The root depends on the adapter only, not on the model: events do not name the model, and an
endpoint serves one base model, so a request is only ever matched against endpoints of its own
model. Blocks whose engine hash mixes in more than the adapter (cache salt, multimodal inputs)
get keys that also mix those extras in, so they keep their chain but never match a plain prompt.

Reference counts, not sets: vLLM stores a hash again when decode re-fills a cached block or a
hit is capped, and then removes it once per physical block, so a block is cached while its
stores outnumber its removes. Counts are kept per engine hash and per (key, endpoint).

Speculative entries bridge the gap between a pick and the engine's own event (the prefill has
not run yet): after a pick the request's keys count as cached on the chosen endpoint for a short
TTL (llm-d: 2 s), so a burst of requests with one prefix follows the first instead of spreading.
The engine's ``BlockStored`` confirms (and replaces) them.

Memory is bounded: an endpoint's blocks are bounded by its KV cache when events are consistent,
and an endpoint holding more than ``max_blocks_per_endpoint`` engine blocks (removes were lost)
is dropped as untrustworthy; speculative entries are capped and expire.
"""

from __future__ import annotations

import logging
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from xxhash import xxh3_64_intdigest

from epp.observability import KV_INDEX_RESETS, KV_UNKEYED_BLOCKS
from epp.prefix.tokens import TokenizerRegistry
from epp.state.registry import StateKey

log = logging.getLogger(__name__)

# Root of every chain; a LoRA adapter's chains start from a root derived from its name.
ROOT_KEY = xxh3_64_intdigest(b"epp-precise-prefix-root")
DEFAULT_MAX_BLOCKS_PER_ENDPOINT = 1 << 18
DEFAULT_MAX_SPECULATIVE = 1 << 18
# Token ids are hashed as unsigned 32-bit integers in native (little-endian) order.
_TOKEN_BYTES = 4


def root_key(lora: str | None) -> int:
    """The "parent" key of a first block: the base model's root or the adapter's own."""
    if lora is None:
        return ROOT_KEY
    return xxh3_64_intdigest(lora.encode("utf-8", "surrogatepass"), ROOT_KEY)


def chain_keys(tokens: Sequence[int], block_size: int, parent: int) -> list[int]:
    """Keys of the full blocks of ``tokens`` (a trailing partial block has none).

    Raises :class:`OverflowError` for token ids outside 0..2**32-1 (no vocabulary has them).
    Linear in the blocks: callers cap them (the precise scorer's ``max_blocks``).
    """
    count = len(tokens) // block_size
    data = array("I", tokens[: count * block_size]).tobytes()
    step = block_size * _TOKEN_BYTES
    key = parent
    return [key := xxh3_64_intdigest(data[i : i + step], key) for i in range(0, len(data), step)]


@dataclass(slots=True)
class _Block:
    """One engine hash on one endpoint: our key for it and how many physical blocks hold it."""

    key: int
    refs: int


class PreciseIndex:
    """Engine blocks of every endpoint, re-keyed; kept in the fleet state under
    :data:`PRECISE_INDEX`.

    Written by the KV-event subscriber and read by the precise prefix scorer, both on the event
    loop thread, so it takes no locks.
    """

    def __init__(
        self,
        max_blocks_per_endpoint: int = DEFAULT_MAX_BLOCKS_PER_ENDPOINT,
        max_speculative: int = DEFAULT_MAX_SPECULATIVE,
    ) -> None:
        self.max_blocks_per_endpoint = max_blocks_per_endpoint
        self.max_speculative = max_speculative
        # endpoint -> engine hash -> block.
        self._blocks: dict[str, dict[int, _Block]] = {}
        # key -> endpoint -> physical blocks holding it (the scorer's lookup table).
        self._holders: dict[int, dict[str, int]] = {}
        # key -> endpoint -> expiry of a speculative entry; expiries in insertion order.
        self._speculative: dict[int, dict[str, float]] = {}
        self._expiries: deque[tuple[float, str, int]] = deque()
        # Block size each endpoint's events announce (for endpoints not scraped yet).
        self._block_sizes: dict[str, int] = {}

    # -- engine events ----------------------------------------------------------------------

    def stored(
        self,
        endpoint: str,
        block_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        lora: str | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> int:
        """Apply a ``BlockStored``; return how many of its blocks were indexed.

        Raises :class:`ValueError`, before changing anything, if the token ids do not fill
        the blocks exactly. Blocks whose parent is unknown (stored before we subscribed, or
        lost in a gap) cannot be keyed and are skipped: they could not be part of a leading
        match anyway.
        """
        if block_size <= 0 or len(token_ids) != block_size * len(block_hashes):
            raise ValueError(
                f"BlockStored with {len(block_hashes)} hashes, block size {block_size} and "
                f"{len(token_ids)} token ids"
            )
        blocks = self._blocks.setdefault(endpoint, {})
        self._block_sizes[endpoint] = block_size
        if parent_hash is None:
            key = root_key(lora)
        else:
            parent = blocks.get(parent_hash)
            if parent is None:
                KV_UNKEYED_BLOCKS.labels(endpoint).inc(len(block_hashes))
                return 0
            key = parent.key
        if extra_keys is None:
            keys = chain_keys(token_ids, block_size, key)
        else:
            keys = _chain_with_extras(token_ids, block_size, key, extra_keys, lora)
        holders = self._holders
        speculative = self._speculative
        for engine_hash, key in zip(block_hashes, keys, strict=True):
            block = blocks.get(engine_hash)
            if block is None:
                blocks[engine_hash] = _Block(key, 1)
            else:
                block.refs += 1
                key = block.key  # the first store decided the key; a re-store repeats it
            held = holders.setdefault(key, {})
            held[endpoint] = held.get(endpoint, 0) + 1
            guessed = speculative.get(key)
            if guessed is not None and guessed.pop(endpoint, None) is not None and not guessed:
                del speculative[key]
        if len(blocks) > self.max_blocks_per_endpoint:
            log.warning(
                "precise prefix index: endpoint %s holds %d blocks (limit %d), removes were "
                "lost; dropping its entries",
                endpoint,
                len(blocks),
                self.max_blocks_per_endpoint,
            )
            KV_INDEX_RESETS.labels(endpoint, "overflow").inc()
            self.drop(endpoint)
        return len(keys)

    def removed(self, endpoint: str, block_hashes: Iterable[int]) -> None:
        """Apply a ``BlockRemoved``: one physical block per hash left the cache."""
        blocks = self._blocks.get(endpoint)
        if not blocks:
            return
        for engine_hash in block_hashes:
            block = blocks.get(engine_hash)
            if block is None:
                continue  # stored before we subscribed, or never keyed
            block.refs -= 1
            if block.refs <= 0:
                del blocks[engine_hash]
            held = self._holders.get(block.key)
            if held is None:
                continue
            refs = held.get(endpoint, 0) - 1
            if refs > 0:
                held[endpoint] = refs
            else:
                held.pop(endpoint, None)
                if not held:
                    del self._holders[block.key]

    def drop(self, endpoint: str) -> None:
        """Forget everything about ``endpoint`` (AllBlocksCleared, a restart, a lost event)."""
        blocks = self._blocks.pop(endpoint, None) or {}
        for block in blocks.values():
            held = self._holders.get(block.key)
            if held is not None and held.pop(endpoint, None) is not None and not held:
                del self._holders[block.key]
        # Picks made before a reset guessed at a cache that is gone.
        for _, ep, key in self._expiries:
            if ep == endpoint:
                self._unspeculate(key, endpoint)
        self._block_sizes.pop(endpoint, None)

    # -- scheduling -------------------------------------------------------------------------

    def add_speculative(self, endpoint: str, keys: Iterable[int], expires_at: float) -> None:
        """Count ``keys`` as cached on ``endpoint`` until ``expires_at`` or the engine's event."""
        speculative = self._speculative
        expiries = self._expiries
        for key in keys:
            speculative.setdefault(key, {})[endpoint] = expires_at
            expiries.append((expires_at, endpoint, key))
        while len(expiries) > self.max_speculative:
            _, ep, key = expiries.popleft()
            self._unspeculate(key, ep)

    def expire(self, now: float) -> None:
        """Forget speculative entries whose TTL is over (memory only: match checks expiry)."""
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            expires_at, ep, key = expiries.popleft()
            if self._speculative.get(key, {}).get(ep) == expires_at:
                self._unspeculate(key, ep)

    def match(self, keys: Sequence[int], endpoints: Sequence[str], now: float) -> dict[str, int]:
        """For each endpoint, how many leading ``keys`` it holds (confirmed or speculative).

        One pass over the keys for all endpoints together, stopping when none is left: the
        cost is the longest match, not endpoints x prompt length.
        """
        result: dict[str, int] = {}
        active = list(endpoints)
        holders = self._holders
        speculative = self._speculative
        for index, key in enumerate(keys):
            held = holders.get(key)
            guessed = speculative.get(key)
            still = []
            for endpoint in active:
                if (held is not None and endpoint in held) or (
                    guessed is not None and guessed.get(endpoint, 0.0) > now
                ):
                    still.append(endpoint)
                else:
                    result[endpoint] = index
            active = still
            if not active:
                return result
        for endpoint in active:
            result[endpoint] = len(keys)
        return result

    def block_size(self, endpoint: str) -> int | None:
        """The block size the endpoint's events announced, if any event was seen."""
        return self._block_sizes.get(endpoint)

    def block_count(self, endpoint: str) -> int:
        """Distinct engine blocks indexed for ``endpoint``."""
        return len(self._blocks.get(endpoint, ()))

    def _unspeculate(self, key: int, endpoint: str) -> None:
        guessed = self._speculative.get(key)
        if guessed is not None and guessed.pop(endpoint, None) is not None and not guessed:
            del self._speculative[key]


def _chain_with_extras(
    tokens: Sequence[int],
    block_size: int,
    parent: int,
    extra_keys: Sequence[object],
    lora: str | None,
) -> list[int]:
    """:func:`chain_keys` for blocks whose engine hash covers more than tokens and adapter.

    ``extra_keys`` has one entry per block: None, or the values vLLM mixed into that block's
    hash. The adapter name is already in the root; anything else (a cache salt, a multimodal
    input's hash) is mixed into the block's key, so the block and every block chained on it
    can never match a plain prompt, as on the engine.
    """
    keys = chain_keys(tokens, block_size, parent)
    if not any(_own_extras(e, lora) for e in extra_keys):
        return keys
    out: list[int] = []
    key = parent
    for i in range(len(keys)):
        key = chain_keys(tokens[i * block_size : (i + 1) * block_size], block_size, key)[0]
        own = _own_extras(extra_keys[i] if i < len(extra_keys) else None, lora)
        if own:
            key = xxh3_64_intdigest(repr(own).encode(), key)
        out.append(key)
    return out


def _own_extras(extra: object, lora: str | None) -> list[object]:
    """A block's extra keys other than its adapter's name (which the root already covers)."""
    if extra is None:
        return []
    if isinstance(extra, list | tuple):
        return [e for e in extra if e != lora]
    return [extra]


# The precise prefix scorer's states. Neither is keyed by a parameter: an entry's key depends on
# the endpoint's own block size (from its events) and the tokenizer on the model's configured
# one, neither on the scorer's. Neither moves on a retry (a speculative entry expires within
# seconds, the engine's events tell the truth) nor replicates (every epp process subscribes to
# every engine's events itself).
PRECISE_INDEX = StateKey("precise-prefix", PreciseIndex)
# The engine's tokenizer of each model, which the server points at the configured ones.
TOKENIZERS = StateKey("tokenizers", TokenizerRegistry)
