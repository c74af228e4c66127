"""SGLang's KV events through epp's decoder and precise index.

The frames are built the way SGLang encodes them, read from its source:
python/sglang/srt/disaggregation/kv_events.py at sgl-project/sglang commit
612d579090db24ec7c47cc5ca6b83e0c649b8c28 (msgspec ``array_like`` structs: ``EventBatch[ts,
events, attn_dp_rank]``; ``BlockStored[block_hashes, parent_block_hash, token_ids, block_size,
lora_id]``; ``BlockRemoved[block_hashes]``; tagged by class name), with the later additions of
``medium`` (``StorageMedium``: ``GPU``, ``CPU_PINNED``, ``DISK``, ``EXTERNAL``) and of
``BlockStoredWithMetadata`` (a ``metadata`` map holding ``cache_salt``), and the radix cache's
event mixin (one event per page, hashes from ``hash_str_to_int64``: signed 64-bit). The
ZmqEventPublisher sends ``[topic, seq as 8 bytes big-endian, msgpack payload]``, as vLLM's.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest

from epp.prefix.precise import PreciseIndex, chain_keys, root_key
from epp.sim.kv_events import SGLangEventPublisher
from epp.sources.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventSubscriber,
    decode_message,
)

PAGE = 4
TOKENS = list(range(200, 212))  # three pages
# Signed int64 hashes, as SGLang's hash_str_to_int64 gives them.
HASHES = [-0x1234_5678_9ABC_DEF0, 0x0FED_CBA9_8765_4321, -1]


def frames(events: list[Any], seq: int = 0, dp_rank: int | None = 0) -> list[bytes]:
    batch: list[Any] = [time.time(), events]
    if dp_rank is not None:
        batch.append(dp_rank)
    return [b"", seq.to_bytes(8, "big"), msgpack.packb(batch)]


def pages(medium: str | None = None) -> list[Any]:
    """SGLang's radix cache storing one node of three pages: one event per page."""
    events = []
    parent = None
    for i, block_hash in enumerate(HASHES):
        event: list[Any] = [
            "BlockStored",
            [block_hash],
            parent,
            TOKENS[i * PAGE : (i + 1) * PAGE],
            PAGE,
            None,
        ]
        if medium is not None:
            event.append(medium)
        events.append(event)
        parent = block_hash
    return events


@pytest.mark.parametrize("medium", [None, "GPU"], ids=["before-medium", "with-medium"])
def test_pages_decode_and_index_as_one_chain(medium: str | None) -> None:
    batch = decode_message(frames(pages(medium)))
    assert [type(e) for e in batch.events] == [BlockStored] * 3
    first = batch.events[0]
    assert isinstance(first, BlockStored)
    assert first.block_hashes == [HASHES[0] & (2**64 - 1)]
    assert first.lora_name is None
    index = PreciseIndex()
    subscriber = KvEventSubscriber(index)
    subscriber.handle("sglang", frames(pages(medium)))
    keys = chain_keys(TOKENS, PAGE, root_key(None))
    assert index.match(keys, ["sglang"], time.monotonic()) == {"sglang": 3}
    assert index.block_size("sglang") == PAGE


def test_removes_with_signed_hashes_undo_the_stores() -> None:
    index = PreciseIndex()
    subscriber = KvEventSubscriber(index)
    subscriber.handle("sglang", frames(pages("GPU"), seq=0))
    removes = [["BlockRemoved", [h], "GPU"] for h in HASHES[1:]]
    subscriber.handle("sglang", frames(removes, seq=1))
    keys = chain_keys(TOKENS, PAGE, root_key(None))
    assert index.match(keys, ["sglang"], time.monotonic()) == {"sglang": 1}
    assert index.block_count("sglang") == 1


def test_lower_tiers_are_not_the_gpu_prefix_cache() -> None:
    for medium in ("CPU_PINNED", "DISK", "EXTERNAL"):
        assert decode_message(frames(pages(medium))).events == []
        assert decode_message(frames([["BlockRemoved", [1], medium]])).events == []


def test_salted_blocks_are_skipped() -> None:
    # BlockStoredWithMetadata: the same tag, the metadata struct (a map) after medium.
    salted = [*pages("GPU")[0], {"cache_salt": "tenant-a"}]
    assert decode_message(frames([salted])).events == []


def test_bigram_pages_are_skipped() -> None:
    bigram = ["BlockStored", [5], None, [[1, 2], [2, 3], [3, 4], [4, 5]], PAGE, None, "GPU"]
    assert decode_message(frames([bigram])).events == []


def test_cleared_and_removed_and_a_batch_without_rank() -> None:
    batch = decode_message(frames([["AllBlocksCleared"], ["BlockRemoved", [-2]]], dp_rank=None))
    assert batch.events == [AllBlocksCleared(), BlockRemoved([2**64 - 2])]


def test_the_simulators_sglang_publisher_speaks_this_format() -> None:
    publisher = SGLangEventPublisher("tcp://127.0.0.1:1", "", PAGE, {})
    unsigned = [h & (2**64 - 1) for h in HASHES]
    publisher.block_stored(unsigned, None, TOKENS, None)
    publisher.block_removed(unsigned[2:])
    publisher.all_cleared()
    sent = publisher.encode_batch()
    _ts, raw, rank = msgpack.unpackb(sent[2])
    assert rank == 0
    assert raw[:3] == pages("GPU")
    assert raw[3:] == [["BlockRemoved", [-1], "GPU"], ["AllBlocksCleared"]]
    assert len(decode_message(sent).events) == 5
