"""Paged KV cache with prefix caching, modelled on vLLM v1's block pool.

The pieces that decide routing quality are kept faithful to vLLM:
- a fixed pool of blocks of `block_size` tokens;
- only full blocks are cached, keyed by a chained hash (parent hash + the block's token ids
  + extra keys such as the LoRA adapter), so one hash names a whole prefix;
- blocks in use carry reference counts (requests sharing a prefix share blocks);
- freed blocks go to the tail of a free queue and keep their hash until reused; new blocks are
  taken from the head, so the least recently freed cached block is evicted first;
- usage counts only blocks with a reference: cached-but-free blocks are free;
- block 0 is vLLM's reserved "null block": never allocated, not counted in usage.
Events (stored/removed/cleared) are reported to a listener so the ZMQ publisher can mirror
vLLM's KV events.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import xxhash

# Seed of the chain (the "parent" of a first block). Fixed, so hashes agree across processes
# and restarts, like vLLM with a fixed PYTHONHASHSEED / sha256 hashing.
ROOT_HASH = xxhash.xxh3_64_intdigest(b"epp-sim-kv-root")


def block_hash(parent: int | None, token_ids: Sequence[int], extra_key: str | None = None) -> int:
    """64-bit chained hash of one full block (deterministic, unlike Python's salted hash())."""
    h = xxhash.xxh3_64()
    h.update(struct.pack("<Q", ROOT_HASH if parent is None else parent))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra_key is not None:
        h.update(extra_key.encode())
    return h.intdigest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: str | None = None,
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is skipped)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], extra_key)
        hashes.append(parent)
    return hashes


class CacheEventListener(Protocol):
    """Receives cache changes in the order they happen (see kv_events.py)."""

    def block_stored(
        self, hashes: list[int], parent: int | None, token_ids: list[int], lora: str | None
    ) -> None: ...

    def block_removed(self, hashes: list[int]) -> None: ...

    def all_cleared(self) -> None: ...


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
        """Drop one reference from each block; blocks reaching zero join the free queue's tail.

        Callers pass a request's blocks in reverse order (as vLLM does) so that the tail of a
        prompt, the part least likely to be shared, is evicted before its head.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.block_id] = block

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

    def reset(self) -> bool:
        """Forget every cached hash (vLLM's reset_prefix_cache); in-use blocks stay allocated."""
        for copies in self.cached.values():
            for block in copies.values():
                block.hash = None
        self.cached.clear()
        if self.listener:
            self.listener.all_cleared()
        return True
