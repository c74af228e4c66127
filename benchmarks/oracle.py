"""An ideal router's prefix-cache hit rate, to judge measured hit rates against.

The oracle pins every affinity key (shared-prefix group, conversation, adapter) to one replica,
keys spread evenly in order of first appearance, and replays the exact request sequence through
a per-replica LRU of block hashes with the replica's full KV capacity. It counts hits with
vLLM v1's rules: only full blocks, a match is the run of leading blocks already cached, and at
most ``len(prompt) - 1`` tokens can hit. Requests are replayed one at a time, so no KV goes to
requests in flight and nothing is preempted: no real router can beat it, though load-aware
placement may trade some of it for lower queueing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from benchmarks.workloads import Item


class Oracle:
    def __init__(self, replicas: int, num_gpu_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        # Block 0 is vLLM's reserved null block.
        self.capacity = num_gpu_blocks - 1
        self.caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
        self.assigned: dict[str, int] = {}

    def _replica(self, key: str) -> int:
        if key not in self.assigned:
            self.assigned[key] = len(self.assigned) % len(self.caches)
        return self.assigned[key]

    def _hashes(self, item: Item) -> list[int]:
        bs = self.block_size
        parent = hash(("lora", item.lora))
        hashes = []
        for start in range(0, len(item.prompt_ids) - bs + 1, bs):
            parent = hash((parent, item.prompt_ids[start : start + bs]))
            hashes.append(parent)
        return hashes

    def replay(self, items: Sequence[Item]) -> float:
        """Hit rate (hit tokens / prompt tokens) of these requests; the caches carry over."""
        hits = queries = 0
        for item in items:
            cache = self.caches[self._replica(item.key)]
            hashes = self._hashes(item)
            limit = (len(item.prompt_ids) - 1) // self.block_size
            matched = 0
            while matched < min(limit, len(hashes)) and hashes[matched] in cache:
                matched += 1
            hits += matched * self.block_size
            queries += len(item.prompt_ids)
            # vLLM frees a request's blocks tail first, so its head is evicted last.
            for h in reversed(hashes):
                cache[h] = None
                cache.move_to_end(h)
            while len(cache) > self.capacity:
                cache.popitem(last=False)
        return hits / queries if queries else 0.0
