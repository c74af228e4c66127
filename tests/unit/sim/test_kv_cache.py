"""Block pool: chained hashes, hits, reference counts, LRU eviction, usage, events."""

from __future__ import annotations

import subprocess
import sys

from epp.sim.kv_cache import BlockPool, block_hash, hash_blocks


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def block_stored(self, hashes, parent, token_ids, lora) -> None:
        self.events.append(("stored", hashes, parent, token_ids, lora))

    def block_removed(self, hashes) -> None:
        self.events.append(("removed", hashes))

    def all_cleared(self) -> None:
        self.events.append(("cleared",))


def test_hashes_are_chained_and_skip_partial_blocks() -> None:
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the 9th token is a partial block
    assert a[0] == block_hash(None, [1, 2, 3, 4])
    assert a[1] == block_hash(a[0], [5, 6, 7, 8])
    # Same second block after a different first block: different hash (it names the prefix).
    b = hash_blocks([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert b[1] != a[1]
    # The LoRA adapter is part of the key.
    assert hash_blocks([1, 2, 3, 4], 4, "lora-a") != a[:1]
    assert all(0 <= h < 2**64 for h in a)


def test_hashes_are_stable_across_processes() -> None:
    code = "from epp.sim.kv_cache import hash_blocks; print(hash_blocks(list(range(8)), 4))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert runs == {f"{hash_blocks(list(range(8)), 4)}\n"}


def fill(pool: BlockPool, tokens: list[int]) -> list:
    """Allocate and cache blocks for `tokens` (full blocks only), like one request."""
    hashes = hash_blocks(tokens, pool.block_size)
    blocks = pool.allocate(len(hashes))
    pool.cache(blocks, hashes, tokens[: len(hashes) * pool.block_size], None, None)
    return blocks


def test_lookup_hits_longest_cached_prefix_and_touch_takes_references() -> None:
    pool = BlockPool(8, 2)
    blocks = fill(pool, [1, 2, 3, 4, 5, 6])
    assert pool.lookup(hash_blocks([1, 2, 3, 4, 9, 9], 2)) == blocks[:2]
    assert pool.lookup(hash_blocks([7, 7, 3, 4], 2)) == []
    pool.touch(blocks[:2])
    assert [b.ref_cnt for b in blocks] == [2, 2, 1]


def test_shared_blocks_stay_used_until_every_reference_is_released() -> None:
    pool = BlockPool(5, 2)  # 4 usable blocks
    blocks = fill(pool, [1, 2, 3, 4])
    pool.touch(blocks)  # a second request shares the prefix
    pool.release(list(reversed(blocks)))
    assert pool.num_free == 2
    assert pool.usage() == 0.5
    pool.release(list(reversed(blocks)))
    assert pool.num_free == 4
    assert pool.usage() == 0.0  # cached but free blocks are not "used"
    assert pool.lookup(hash_blocks([1, 2, 3, 4], 2)) == blocks  # ...and still hit


def test_eviction_takes_least_recently_freed_and_tail_blocks_first() -> None:
    rec = Recorder()
    pool = BlockPool(7, 2, rec)  # 6 usable blocks
    old = fill(pool, [1, 1, 2, 2])
    new = fill(pool, [3, 3, 4, 4])
    pool.release(list(reversed(old)))  # freed first -> evicted first, tail before head
    pool.release(list(reversed(new)))
    rec.events.clear()
    pool.allocate(3)  # 2 never-used blocks + 1 eviction
    assert rec.events == [("removed", [hash_blocks([1, 1, 2, 2], 2)[1]])]
    assert pool.lookup(hash_blocks([1, 1, 2, 2], 2)) == old[:1]
    pool.allocate(1)
    assert pool.lookup(hash_blocks([1, 1], 2)) == []
    assert pool.lookup(hash_blocks([3, 3, 4, 4], 2)) == new


def test_touching_a_free_cached_block_protects_it_from_eviction() -> None:
    pool = BlockPool(3, 2)  # 2 usable blocks
    a = fill(pool, [1, 1])
    pool.release(a)
    fill(pool, [2, 2])  # takes the never-used block
    pool.touch(pool.lookup(hash_blocks([1, 1], 2)))
    assert pool.num_free == 0


def test_stored_event_carries_chain_parent_and_tokens() -> None:
    rec = Recorder()
    pool = BlockPool(8, 2, rec)
    hashes = hash_blocks([1, 2, 3, 4], 2)
    blocks = pool.allocate(2)
    pool.cache(blocks[1:], hashes[1:], [3, 4], hashes[0], "a")
    assert rec.events == [("stored", hashes[1:], hashes[0], [3, 4], "a")]


def test_reset_forgets_hashes_and_announces_it() -> None:
    rec = Recorder()
    pool = BlockPool(8, 2, rec)
    fill(pool, [1, 2, 3, 4])
    pool.reset()
    assert pool.lookup(hash_blocks([1, 2], 2)) == []
    assert rec.events[-1] == ("cleared",)
