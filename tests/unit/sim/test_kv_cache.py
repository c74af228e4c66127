"""Block pool: vLLM's chained hashes, hits, reference counts, LRU eviction, usage, events."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack

from epp.sim.kv_cache import (
    BlockPool,
    block_digest,
    external_hash,
    hash_block_digests,
    hash_blocks,
    lora_extra_keys,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def block_stored(self, hashes, parent, token_ids, lora) -> None:
        self.events.append(("stored", hashes, parent, token_ids, lora))

    def block_removed(self, hashes) -> None:
        self.events.append(("removed", hashes))

    def all_cleared(self) -> None:
        self.events.append(("cleared",))

    def end_step(self) -> None:
        self.events.append(("end_step",))


def test_hashes_are_chained_and_skip_partial_blocks() -> None:
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the 9th token is a partial block
    d0 = block_digest(None, [1, 2, 3, 4], None)
    assert a[0] == external_hash(d0)
    # The chain runs on full 32-byte digests; events carry their low 64 bits.
    assert a[1] == external_hash(block_digest(d0, [5, 6, 7, 8], None))
    assert hash_block_digests([1, 2, 3, 4, 5, 6, 7, 8], 4)[0] == d0
    # Same second block after a different first block: different hash (it names the prefix).
    b = hash_blocks([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert b[1] != a[1]
    # The LoRA adapter (name and path) is part of the key.
    assert hash_blocks([1, 2, 3, 4], 4, lora_extra_keys("lora-a", "/a")) != a[:1]
    assert hash_blocks([1, 2, 3, 4], 4, lora_extra_keys("lora-a", "/b")) != hash_blocks(
        [1, 2, 3, 4], 4, lora_extra_keys("lora-a", "/a")
    )
    assert all(0 <= h < 2**64 for h in a)


def _stored_events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        frames = [base64.b64decode(f) for f in json.loads(line)["frames_b64"]]
        _, events, _ = msgpack.unpackb(frames[2])
        out += [e for e in events if e["type"] == "BlockStored"]
    return out


def test_hashes_equal_a_real_vllm_servers() -> None:
    """Every first-of-prompt BlockStored captured from vLLM 0.32 recomputes to the same hashes:
    a router that derives hashes from token ids sees the simulator like a real fleet."""
    stored = [e for e in _stored_events(FIXTURES / "kv_events.msgpack.jsonl")]
    firsts = [e for e in stored if e["parent_block_hash"] is None and e["lora_name"] is None]
    assert len(firsts) >= 3
    for e in firsts:
        assert hash_blocks(e["token_ids"], e["block_size"]) == e["block_hashes"]


def test_lora_hashes_equal_a_real_vllm_servers() -> None:
    """vLLM hashes a LoRA request's blocks with ("lora", name, path). The path is the one the
    capturing server loaded the adapter from, which it reports as the adapter's ``root`` in
    /v1/models (not this checkout's location)."""
    stored = _stored_events(FIXTURES / "kv_events_lora.msgpack.jsonl")
    (first,) = [e for e in stored if e["parent_block_hash"] is None and e["lora_name"]]
    models = json.loads((FIXTURES / "models_lora.json").read_text())["data"]
    (path,) = [m["root"] for m in models if m["id"] == first["lora_name"]]
    keys = lora_extra_keys(first["lora_name"], path)
    assert hash_blocks(first["token_ids"], first["block_size"], keys) == first["block_hashes"]
    assert first["extra_keys"] == [[first["lora_name"]]] * len(first["block_hashes"])


def _hashes_in_subprocess(seed: str | None) -> str:
    code = "from epp.sim.kv_cache import hash_blocks; print(hash_blocks(list(range(8)), 4))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout


def test_hashes_are_stable_across_processes_and_seeded_like_vllm() -> None:
    # Without PYTHONHASHSEED every process salts str hashes differently: the block hashes
    # must not depend on that (sha256 over pickle, as vLLM). When it is set, vLLM derives its
    # root hash from it, and so does the simulator.
    unseeded = {_hashes_in_subprocess(None) for _ in range(2)}
    assert len(unseeded) == 1
    if "PYTHONHASHSEED" not in os.environ:
        assert unseeded == {f"{hash_blocks(list(range(8)), 4)}\n"}
    assert _hashes_in_subprocess("7") not in unseeded


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
    blocks = fill(pool, [1, 2, 3, 4])
    # vLLM refuses while blocks are in use, and says nothing.
    assert pool.reset() is False
    assert pool.lookup(hash_blocks([1, 2], 2)) == blocks[:1]
    assert rec.events[-1][0] == "stored"
    pool.release(list(reversed(blocks)))
    assert pool.reset() is True
    assert pool.lookup(hash_blocks([1, 2], 2)) == []
    assert rec.events[-1] == ("cleared",)


def test_forced_reset_keeps_in_use_blocks_allocated() -> None:
    rec = Recorder()
    pool = BlockPool(8, 2, rec)
    fill(pool, [1, 2, 3, 4])
    assert pool.reset(force=True) is True
    assert pool.lookup(hash_blocks([1, 2], 2)) == []
    assert pool.num_used == 2
    assert rec.events[-1] == ("cleared",)


def test_freed_uncached_blocks_are_reused_before_any_cached_block_is_evicted() -> None:
    """vLLM's free_blocks prepends blocks without a hash (a prompt's partial tail) to the free
    queue and appends cached ones, so a partial block never pushes a cached block out."""
    rec = Recorder()
    pool = BlockPool(5, 2, rec)  # 4 usable blocks
    full = fill(pool, [1, 1, 2, 2])  # 2 cached blocks
    partial = pool.allocate(1)  # e.g. the last, partial block of the same prompt
    pool.release(list(reversed(full + partial)))
    assert next(iter(pool.free)) == partial[0].block_id  # head: reused first
    assert list(pool.free)[-2:] == [full[1].block_id, full[0].block_id]  # tail first out
    rec.events.clear()
    pool.allocate(2)  # the partial block and the never-used one: no eviction
    assert rec.events == []
    pool.allocate(1)
    assert rec.events == [("removed", [hash_blocks([1, 1, 2, 2], 2)[1]])]
