"""KV-event decoding (real vLLM frames, legacy forms) and the subscriber's trust rules."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import msgpack
import pytest
import zmq
import zmq.asyncio
from prometheus_client import REGISTRY

from epp.prefix.precise import PreciseIndex, chain_keys, root_key
from epp.prefix.tokens import TokenizerRegistry
from epp.request import RequestPolicy, parse_request
from epp.sim.tokenization import BUNDLED_DIR
from epp.sources.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventSubscriber,
    MalformedMessage,
    decode_event,
    decode_message,
)
from tests.unit.prefix.helpers import CLEARED, FIXTURES, captured, message, removed, stored

TOKENS = list(range(100, 132))


def resets(endpoint: str, reason: str) -> float:
    labels = {"endpoint": endpoint, "reason": reason}
    return REGISTRY.get_sample_value("epp_kv_index_resets_total", labels) or 0.0


def subscriber() -> tuple[PreciseIndex, KvEventSubscriber]:
    index = PreciseIndex()
    return index, KvEventSubscriber(index)


# -- decoding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kv_events", "kv_events_lora"])
def test_every_captured_real_frame_decodes_like_the_capture(name: str) -> None:
    lines = list(captured(name))
    assert lines
    for record in lines:
        batch = decode_message(record["frames"])
        assert batch.seq == record["seq"]
        ts, raw_events, dp_rank = record["decoded"]
        assert batch.ts == ts
        assert dp_rank == 0
        assert len(batch.events) == len(raw_events)
        for ours, raw in zip(batch.events, raw_events, strict=True):
            assert type(ours).__name__ == raw["type"]
            if isinstance(ours, BlockStored):
                assert ours.block_hashes == raw["block_hashes"]
                assert ours.parent_block_hash == raw["parent_block_hash"]
                assert ours.token_ids == raw["token_ids"]
                assert ours.block_size == raw["block_size"] == 32
                assert ours.lora_name == raw["lora_name"]
                assert ours.extra_keys == raw["extra_keys"]
            elif isinstance(ours, BlockRemoved):
                assert ours.block_hashes == raw["block_hashes"]


def test_replaying_the_captured_stream_keeps_the_engines_cache() -> None:
    """Gaps in the capture (dropped phases) reset the endpoint; the reset phase's prompt is
    what remains cached, its 15 full prompt blocks plus the block decode filled."""
    index, sub = subscriber()
    ep = "replay:8000"
    records = list(captured())
    for record in records:
        sub.handle(ep, record["frames"])
    assert resets(ep, "gap") == 2  # 12 -> 184 and 184 -> 187
    assert resets(ep, "cleared") == 1
    last_prompt = next(r for r in records if r["phase"] == "after_reset")
    prompt_tokens = last_prompt["decoded"][1][1]["token_ids"]  # after AllBlocksCleared
    assert len(prompt_tokens) == 15 * 32
    assert index.match(chain_keys(prompt_tokens, 32, root_key(None)), [ep], 0.0) == {ep: 15}
    assert index.block_count(ep) == 16


def test_captured_chat_block_is_keyed_like_our_tokenization_of_that_request() -> None:
    """The engine's first block of the chat request equals our chat template + tokenizer."""
    index, sub = subscriber()
    first = next(captured())
    assert first["phase"] == "chat_stream"
    sub.handle("chat:8000", first["frames"])
    body = json.loads((FIXTURES / "chat_stream.request.json").read_text())["body"]
    request = parse_request("/v1/chat/completions", {}, json.dumps(body).encode(), RequestPolicy())
    registry = TokenizerRegistry()
    registry.set_models({"tiny": str(BUNDLED_DIR)})
    tokens = registry.token_ids(request)
    assert tokens is not None
    assert len(tokens) == 38
    keys = chain_keys(tokens, 32, root_key(None))
    assert index.match(keys, ["chat:8000"], 0.0) == {"chat:8000": 1}


def test_captured_lora_blocks_match_the_adapter_only() -> None:
    index, sub = subscriber()
    records = list(captured("kv_events_lora"))
    for record in records:
        sub.handle("lora:8000", record["frames"])
    lora_first = next(r for r in records if r["phase"] == "lora_request")["decoded"][1][0]
    assert lora_first["lora_name"] == "tiny-lora"
    tokens = lora_first["token_ids"]
    with_adapter = chain_keys(tokens, 32, root_key("tiny-lora"))
    assert index.match(with_adapter, ["lora:8000"], 0.0) == {"lora:8000": 3}
    assert index.match(chain_keys(tokens, 32, root_key(None)), ["lora:8000"], 0.0) == {
        "lora:8000": 0
    }


def test_legacy_positional_events_and_batch_forms() -> None:
    """msgspec array_like events from older vLLM, with and without trailing fields."""
    old = ["BlockStored", [1], None, TOKENS[:4], 4, None]  # 0.9: no medium yet
    newer = ["BlockStored", [2], 1, TOKENS[4:8], 4, None, "GPU", None, [None], 0, "full_attention"]
    future = [*newer[:1], [3], 2, TOKENS[8:12], *newer[4:], "extra-field"]
    gone = ["BlockRemoved", [3], "GPU"]
    for payload in (
        [1.0, [old, newer, future, gone]],  # EventBatch without data_parallel_rank
        [1.0, [old, newer, future, gone], 0],
        {"ts": 1.0, "events": [old, newer, future, gone], "data_parallel_rank": 0},
    ):
        index, sub = subscriber()
        sub.handle("legacy", message(0, payload=payload))
        keys = chain_keys(TOKENS, 4, root_key(None))
        assert index.match(keys, ["legacy"], 0.0) == {"legacy": 2}
    assert decode_event(["AllBlocksCleared"]) == AllBlocksCleared()


def test_legacy_lora_id_without_name_never_matches_base_prompts() -> None:
    event = decode_event(["BlockStored", [1], None, TOKENS[:4], 4, 7])
    assert isinstance(event, BlockStored)
    assert event.lora_name is not None
    assert "7" in event.lora_name


def test_hash_encodings_are_normalised_to_uint64() -> None:
    event = decode_event(
        {**stored([-1, 5], TOKENS[:8]), "parent_block_hash": b"\x00" * 24 + b"\x01" * 8}
    )
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [2**64 - 1, 5]
    assert event.parent_block_hash == int.from_bytes(b"\x01" * 8, "big")


@pytest.mark.parametrize(
    "fields",
    [
        {"medium": "CPU"},
        {"medium": "CPU_PINNED"},
        {"kv_cache_spec_kind": "sliding_window"},
        {"kv_cache_spec_kind": None, "group_idx": 1},
    ],
)
def test_events_of_other_tiers_and_groups_are_skipped(fields: dict[str, object]) -> None:
    assert decode_event({**stored([1], TOKENS[:4]), **fields}) is None
    assert decode_event({**removed(1), **fields}) is None


def test_unknown_event_types_are_skipped() -> None:
    assert decode_event({"type": "BlockPinned", "block_hashes": [1]}) is None
    assert decode_event(["BlockPinned", [1]]) is None


@pytest.mark.parametrize(
    "frames",
    [
        [b"kv-events", b"\x00" * 8],
        [b"kv-events", b"\x00" * 4, msgpack.packb([1.0, [], 0])],
        [b"kv-events", b"\x00" * 8, b"\xc1not msgpack"],
        [b"kv-events", b"\x00" * 8, msgpack.packb("hello")],
        [b"kv-events", b"\x00" * 8, msgpack.packb([1.0, "events"])],
        [b"kv-events", b"\x00" * 8, msgpack.packb([1.0, [42]])],
        [b"kv-events", b"\x00" * 8, msgpack.packb([1.0, [{"type": "BlockStored"}]])],
        [b"kv-events", b"\x00" * 8, msgpack.packb([1.0, [removed(1) | {"block_hashes": ["x"]}]])],
    ],
)
def test_malformed_messages_are_rejected(frames: list[bytes]) -> None:
    with pytest.raises(MalformedMessage):
        decode_message(frames)


# -- trust --------------------------------------------------------------------------------------


def test_gap_drops_the_endpoint_then_applies_the_new_message() -> None:
    index, sub = subscriber()
    sub.handle("g", message(0, stored([1, 2], TOKENS[:8])))
    sub.handle("g", message(1, stored([3], TOKENS[8:12], parent=2)))
    assert index.block_count("g") == 3
    sub.handle("g", message(5, stored([9], TOKENS[:4])))  # 2..4 lost: removes may be among them
    assert resets("g", "gap") == 1
    assert index.block_count("g") == 1
    sub.handle("g", message(6, stored([10], TOKENS[4:8], parent=9)))
    assert index.block_count("g") == 2


def test_sequence_going_back_is_an_engine_restart() -> None:
    index, sub = subscriber()
    sub.handle("r", message(0, stored([1, 2], TOKENS[:8])))
    sub.handle("r", message(1, stored([3], TOKENS[8:12], parent=2)))
    sub.handle("r", message(0, stored([1], TOKENS[:4])))
    assert resets("r", "restart") == 1
    assert index.block_count("r") == 1
    sub.handle("r", message(0))  # restarted again right after its first message
    assert resets("r", "restart") == 2


def test_all_blocks_cleared_drops_the_endpoint_within_its_batch() -> None:
    """vLLM sends AllBlocksCleared with the next step's stores (fixtures README)."""
    index, sub = subscriber()
    sub.handle("c", message(0, stored([1, 2], TOKENS[:8])))
    sub.handle("c", message(1, CLEARED, stored([5], TOKENS[:4])))
    keys = chain_keys(TOKENS, 4, root_key(None))
    assert index.match(keys, ["c"], 0.0) == {"c": 1}
    assert resets("c", "cleared") == 1


def test_garbage_resets_only_its_endpoint_and_the_next_message_is_accepted() -> None:
    index, sub = subscriber()
    sub.handle("good", message(0, stored([1, 2], TOKENS[:8])))
    sub.handle("bad", message(0, stored([1, 2], TOKENS[:8])))
    sub.handle("bad", [b"kv-events", (1).to_bytes(8, "big"), b"\xc1"])
    sub.handle("bad", message(7, stored([1], TOKENS[:4])))  # no sequence to compare with
    assert resets("bad", "malformed") == 1
    assert resets("bad", "gap") == 0
    assert index.block_count("bad") == 1
    assert index.block_count("good") == 2


def test_an_event_the_index_cannot_apply_drops_the_endpoint() -> None:
    index, sub = subscriber()
    sub.handle("x", message(0, stored([1, 2], TOKENS[:8])))
    sub.handle("x", message(1, stored([3, 4], TOKENS[:5])))  # 5 token ids for 2 blocks of 4
    assert resets("x", "malformed") == 1
    assert index.block_count("x") == 0
    sub.handle("x", message(2, stored([1], TOKENS[:4])))
    assert index.block_count("x") == 1


def test_each_reset_reason_is_logged_once_per_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    _, sub = subscriber()
    with caplog.at_level(logging.WARNING, logger="epp.sources.kv_events"):
        for seq in (0, 2, 4, 6):
            sub.handle("noisy", message(seq))
    assert resets("noisy", "gap") == 3
    assert len([r for r in caplog.records if "gap" in r.getMessage()]) == 1


# -- over ZMQ -----------------------------------------------------------------------------------


async def test_subscribes_to_a_bound_publisher_and_follows_reconfiguration() -> None:
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    other = ctx.socket(zmq.PUB)
    other.setsockopt(zmq.LINGER, 0)
    other_port = other.bind_to_random_port("tcp://127.0.0.1")
    index = PreciseIndex()
    sub = KvEventSubscriber(index, topic="kv-events")
    # A publisher that is not there: just no events.
    dead = "tcp://127.0.0.1:1"
    sub.set_endpoints({"ep": f"tcp://127.0.0.1:{port}", "dead": dead})
    await sub.start()
    try:
        seq = 0

        async def publish_until_seen() -> None:
            nonlocal seq
            deadline = time.monotonic() + 5
            while index.block_count("ep") == 0:  # ZMQ slow joiner: resend until subscribed
                assert time.monotonic() < deadline, "no event received"
                await pub.send_multipart(message(seq, topic=b"other-topic"))
                await pub.send_multipart(message(seq, stored([seq + 1], TOKENS[:4])))
                seq += 1
                await asyncio.sleep(0.05)

        await publish_until_seen()
        assert resets("ep", "gap") == 0  # other topics were filtered, not counted as gaps
        # Moving the endpoint to another publisher forgets what the old one said.
        sub.set_endpoints({"ep": f"tcp://127.0.0.1:{other_port}"})
        assert index.block_count("ep") == 0
        deadline = time.monotonic() + 5
        while index.block_count("ep") == 0:
            assert time.monotonic() < deadline, "no event from the new publisher"
            await other.send_multipart(message(0, stored([1], TOKENS[:4])))
            await asyncio.sleep(0.05)
        sub.set_endpoints({})
        assert not sub._streams
        assert index.block_count("ep") == 0
    finally:
        await sub.stop()
        pub.close(linger=0)
        other.close(linger=0)
