"""Per-request KV block bookkeeping on top of the block pool (vLLM's KVCacheManager)."""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.sim.kv_cache import Block, BlockPool, PrefixCacheStats
from epp.sim.request import SimRequest


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVCacheManager:
    pool: BlockPool
    enable_prefix_caching: bool = True
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    req_blocks: dict[SimRequest, list[Block]] = field(default_factory=dict)
    # Number of each request's leading blocks already registered in the cache.
    req_cached: dict[SimRequest, int] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def get_computed_blocks(self, req: SimRequest) -> tuple[list[Block], int]:
        """Longest cached prefix of a request about to start (or restart after preemption).

        As in vLLM v1 the last prompt token is always recomputed (its logits are needed), so a
        hit covers at most num_tokens - 1 tokens, in whole blocks. Nothing is counted here:
        see record_prefix_cache_stats.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        blocks = self.pool.lookup(req.block_hashes(self.block_size)[:max_hit_blocks])
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_stats(self, req: SimRequest, num_hit: int) -> None:
        """Count a lookup once the request is admitted (vLLM records at admission, so a request
        that waits for blocks over several steps is counted once). Queries count every token of
        the request, hits the tokens found; lookups of preempted requests are not counted
        (vLLM reports those separately)."""
        if self.enable_prefix_caching and req.num_preemptions == 0:
            self.stats.queries += req.num_tokens
            self.stats.hits += num_hit

    def num_blocks_needed(self, req: SimRequest, num_new_tokens: int, num_hit_blocks: int) -> int:
        """Blocks to take from the pool to hold the request's computed + new tokens."""
        computed = req.num_computed_tokens + num_hit_blocks * self.block_size
        have = len(self.req_blocks.get(req, ())) + num_hit_blocks
        return max(0, cdiv(computed + num_new_tokens, self.block_size) - have)

    def allocate_slots(
        self, req: SimRequest, num_new_tokens: int, computed: list[Block] | None = None
    ) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens; False (and no change) if short.

        Cache hits that sit in the free queue do not count as free for this request: touching
        them removes them from the queue, as in vLLM.
        """
        computed = computed or []
        end = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = self.num_blocks_needed(req, num_new_tokens, len(computed))
        evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if need > self.pool.num_free - evictable_hits:
            return False
        self.pool.touch(computed)
        blocks = self.req_blocks.setdefault(req, [])
        blocks += computed
        if computed:
            self.req_cached[req] = len(blocks)
        blocks += self.pool.allocate(need)
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, end)
        return True

    def _cache_full_blocks(self, req: SimRequest, num_tokens: int) -> None:
        """Register the blocks that become full once `num_tokens` tokens are computed."""
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        done = self.req_cached.get(req, 0)
        if num_full <= done:
            return
        hashes = req.block_hashes(self.block_size)
        bs = self.block_size
        self.pool.cache(
            self.req_blocks[req][done:num_full],
            hashes[done:num_full],
            req.all_token_ids[done * bs : num_full * bs],
            hashes[done - 1] if done else None,
            req.lora,
        )
        self.req_cached[req] = num_full

    def free(self, req: SimRequest) -> None:
        """Release a finished or preempted request's blocks, tail first (see BlockPool.release)."""
        blocks = self.req_blocks.pop(req, [])
        self.req_cached.pop(req, None)
        self.pool.release(list(reversed(blocks)))
