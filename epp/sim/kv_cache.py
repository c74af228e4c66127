"""Paged KV cache with prefix caching, modelled on vLLM v1's block pool.

The pieces that decide routing quality are kept faithful to vLLM (checked against a real vLLM
0.32 by tests/contract/test_sim_vs_vllm.py):
- a fixed pool of blocks of `block_size` tokens;
- only full blocks are cached, keyed by vLLM's own chained block hash (sha256 over the parent
  hash, the block's token ids and extra keys such as the LoRA adapter), so one hash names a
  whole prefix and a prompt gets the same hashes here as on a real vLLM server;
- blocks in use carry reference counts (requests sharing a prefix share blocks);
- freed blocks with a hash go to the tail of a free queue and keep their hash until reused,
  freed blocks without one (partial blocks) go to its head; new blocks are taken from the
  head, so uncached blocks are reused first and then the least recently freed cached block is
  evicted;
- usage counts only blocks with a reference: cached-but-free blocks are free;
- block 0 is vLLM's reserved "null block": never allocated, not counted in usage.
Events (stored/removed/cleared) are reported to a listener so the ZMQ publisher can mirror
vLLM's KV events.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# vLLM's default seed for the chain's root (DEFAULT_NONE_HASH_SEED); PYTHONHASHSEED replaces it
# there, so it does here too: a router that recomputes hashes needs the same root as the fleet.
NONE_HASH_SEED = "vllm-none-hash"


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's `sha256` hash function: SHA-256 of the object pickled with the highest protocol."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


# The "parent" of a first block (vLLM's NONE_HASH). Fixed, so hashes agree across processes and
# restarts, as with vLLM's default prefix_caching_hash_algo=sha256.
NONE_HASH = sha256_pickle(os.environ.get("PYTHONHASHSEED", NONE_HASH_SEED))

# Extra keys mixed into every block hash of a request: vLLM uses (("lora", name, path),) for a
# LoRA request (so re-pointing a name at another adapter cannot reuse old KV), None otherwise.
ExtraKeys = tuple[Any, ...] | None


def lora_extra_keys(name: str | None, path: str | None) -> ExtraKeys:
    """The extra keys vLLM hashes into a LoRA request's blocks (its _gen_lora_extra_hash_keys)."""
    return None if name is None else (("lora", name, path),)


def block_digest(parent: bytes | None, token_ids: Sequence[int], extra_keys: ExtraKeys) -> bytes:
    """32-byte hash of one full block, chained on its parent's digest (vLLM's hash_block_tokens)."""
    return sha256_pickle((parent or NONE_HASH, tuple(token_ids), extra_keys))


def external_hash(digest: bytes) -> int:
    """What KV events carry for a digest: its last 8 bytes as an unsigned int (vLLM's
    maybe_convert_block_hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default)."""
    return int.from_bytes(digest[-8:], "big")


def hash_block_digests(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: ExtraKeys = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained digests of every full block of `token_ids` (a trailing partial block is skipped).

    block_digest inlined: this runs for every prompt block (a few us each), on the event loop.
    """
    sha256, dumps, protocol = hashlib.sha256, pickle.dumps, pickle.HIGHEST_PROTOCOL
    tokens = tuple(token_ids)
    digest = parent or NONE_HASH
    digests = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        digest = sha256(dumps((digest, block, extra_keys), protocol)).digest()
        digests.append(digest)
    return digests


def hash_blocks(
    token_ids: Sequence[int], block_size: int, extra_keys: ExtraKeys = None
) -> list[int]:
    """The block hashes a vLLM server publishes for a prompt (only its full blocks)."""
    return [external_hash(d) for d in hash_block_digests(token_ids, block_size, extra_keys)]


class CacheEventListener(Protocol):
    """Receives cache changes in the order they happen (see kv_events.py)."""

    def block_stored(
        self, hashes: list[int], parent: int | None, token_ids: list[int], lora: str | None
    ) -> None: ...

    def block_removed(self, hashes: list[int]) -> None: ...

    def all_cleared(self) -> None: ...

    def end_step(self) -> None:
        """An engine step is over: the events raised so far form one batch (vLLM publishes a
        step's events together, after the step's model run)."""


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    hash: int | None = None


@dataclass
class PrefixCacheStats:
    """Token-level counters, as vLLM's `PrefixCacheStats` (queries/hits in tokens)."""

    queries: int = 0
    hits: int = 0
    # A KV connector's lookups (requests' tokens) and the tokens it loaded.
    external_queries: int = 0
    external_hits: int = 0


@dataclass
class BlockPool:
    """The blocks, their free queue (LRU order) and the hash -> cached block map."""

    num_blocks: int
    block_size: int
    listener: CacheEventListener | None = None
    blocks: list[Block] = field(init=False)
    # Insertion-ordered: head = evicted first. Python dict ops make touch/free O(1).
    free: OrderedDict[int, Block] = field(init=False)
    # hash -> {block_id: block}. Several blocks may hold the same content when two requests
    # computed it concurrently; vLLM keeps them all and serves hits from any of them.
    cached: dict[int, dict[int, Block]] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (one is the reserved null block)")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def lookup(self, hashes: Sequence[int]) -> list[Block]:
        """Longest run of leading hashes that are cached (blocks may be in use or free)."""
        found = []
        for h in hashes:
            copies = self.cached.get(h)
            if not copies:
                break
            found.append(next(iter(copies.values())))
        return found

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on cache hits; a free cached block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks from the head of the free queue, evicting their cached hashes."""
        if n > len(self.free):
            raise MemoryError(f"need {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)
            if block.hash is not None:
                # One event per evicted block, as vLLM's _maybe_evict_cached_block.
                if self.listener:
                    self.listener.block_removed([block.hash])
                copies = self.cached[block.hash]
                del copies[block.block_id]
                if not copies:
                    del self.cached[block.hash]
                block.hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block and queue the blocks that reach zero.

        As vLLM's free_blocks: cached blocks join the queue's tail (FIFO, so the least recently
        freed is evicted first) and blocks without a hash, which can never be hit, go to its
        head (LIFO), so they are reused before any cached block is evicted. Callers pass a
        request's blocks in reverse order (as vLLM does) so that the tail of a prompt, the part
        least likely to be shared, is evicted before its head.
        """
        uncached = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.hash is None:
                    uncached.append(block)
                else:
                    self.free[block.block_id] = block
        # vLLM's prepend_n keeps the given order at the head of the queue.
        for block in reversed(uncached):
            self.free[block.block_id] = block
            self.free.move_to_end(block.block_id, last=False)

    def cache(
        self,
        blocks: Sequence[Block],
        hashes: Sequence[int],
        token_ids: Sequence[int],
        parent: int | None,
        lora: str | None,
    ) -> None:
        """Register newly filled blocks under their hashes and announce them in one event."""
        for block, h in zip(blocks, hashes, strict=True):
            block.hash = h
            self.cached.setdefault(h, {})[block.block_id] = block
        if blocks and self.listener:
            self.listener.block_stored(list(hashes), parent, list(token_ids), lora)

    @property
    def num_used(self) -> int:
        """Blocks referenced by requests (the null block excluded)."""
        return self.num_blocks - 1 - self.num_free

    def reset(self, force: bool = False) -> bool:
        """Forget every cached hash (vLLM's reset_prefix_cache).

        vLLM refuses (returns False, no event) while any block is in use; `force` (the
        simulator's clear_cache fault) drops the hashes anyway and in-use blocks stay allocated.
        """
        if self.num_used and not force:
            return False
        for copies in self.cached.values():
            for block in copies.values():
                block.hash = None
        self.cached.clear()
        if self.listener:
            self.listener.all_cleared()
        return True
