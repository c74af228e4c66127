"""KV events on a real ZMQ SUB socket: frame layout, event fields, eviction and clear."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epp.sim.kv_cache import hash_blocks

from .conftest import engine_config


async def subscribe(endpoint: str, topic: bytes) -> zmq.asyncio.Socket:
    """A SUB socket connected to ``endpoint``, returned once its handshake with the publisher
    is done. PUB drops what it sends before a subscriber joins (by design), so the join is
    awaited as an event (the socket monitor's), not given a fixed time a busy machine can
    outlast. The subscription goes out right behind the handshake, well before the request
    the test sends next makes the engine publish."""
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(endpoint)
        event = parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), 10))
        assert event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED, event
    finally:
        sock.disable_monitor()
        monitor.close()
    return sock


async def receive(sock: zmq.asyncio.Socket, want: str) -> list[tuple[int, dict[str, Any]]]:
    """Collect (seq, event) until an event of type `want` arrives."""
    out = []
    while True:
        frames = await asyncio.wait_for(sock.recv_multipart(), 5)
        assert len(frames) == 3
        topic, seq, payload = frames
        assert topic == b"kv-events"
        assert len(seq) == 8
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float)
        assert dp_rank == 0
        for e in events:
            out.append((int.from_bytes(seq, "big"), e))
        if any(e["type"] == want for e in events):
            return out


async def complete(address: str, body: dict[str, Any]) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://{address}/v1/completions", json=body) as r,
    ):
        assert r.status == 200


async def test_block_stored_then_removed_then_cleared(start_replica, tmp_path) -> None:
    # ipc:// endpoints are bound (vLLM's rule), like tcp://*:PORT, without opening a port.
    endpoint = f"ipc://{tmp_path}/events"
    # 7 usable blocks of 4 tokens: a second long prompt forces evictions.
    r = await start_replica(engine=engine_config(num_gpu_blocks=8), kv_events_endpoint=endpoint)
    sock = await subscribe(endpoint, b"kv-events")
    try:
        prompt = list(range(1, 18))  # 4 full blocks + 1 token
        await complete(r.config.address, {"prompt": prompt, "max_tokens": 1})
        got = await receive(sock, "BlockStored")
        seq, stored = got[0]
        assert seq == 0
        assert list(stored) == [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
        ]
        assert stored["block_hashes"] == hash_blocks(prompt, 4)
        assert stored["parent_block_hash"] is None
        assert stored["token_ids"] == prompt[:16]
        assert stored["block_size"] == 4
        assert stored["medium"] == "GPU"
        assert stored["lora_id"] is None

        await complete(r.config.address, {"prompt": list(range(100, 117)), "max_tokens": 1})
        got = await receive(sock, "BlockRemoved")
        removed = [e for _, e in got if e["type"] == "BlockRemoved"]
        assert removed[0] == {
            "type": "BlockRemoved",
            "block_hashes": [hash_blocks(prompt, 4)[3]],  # the tail block goes first
            "medium": "GPU",
            "group_idx": 0,
        }
        assert [s for s, _ in got] == sorted(s for s, _ in got)

        async with (
            aiohttp.ClientSession() as s,
            s.post(f"http://{r.config.address}/admin/faults", json={"clear_cache": True}) as resp,
        ):
            assert resp.status == 200
        # As in vLLM, the clear waits for the next engine step and shares its batch.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sock.recv_multipart(), 0.3)
        await complete(r.config.address, {"prompt": list(range(200, 209)), "max_tokens": 1})
        frames = await asyncio.wait_for(sock.recv_multipart(), 5)
        _, events, _ = msgpack.unpackb(frames[2])
        assert [e["type"] for e in events] == ["AllBlocksCleared", "BlockStored"]
        assert events[0] == {"type": "AllBlocksCleared"}
    finally:
        sock.close()


async def test_reset_prefix_cache_answers_like_vllm(start_replica) -> None:
    """POST /reset_prefix_cache: {"success": bool}, refused while a request holds blocks."""
    # Unscaled steps (~3 ms each): the 50-token request is still running at the first reset.
    r = await start_replica(engine=engine_config(time_scale=1.0))
    base = f"http://{r.config.address}"
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(
            complete(r.config.address, {"prompt": list(range(300, 340)), "max_tokens": 50})
        )
        for _ in range(200):  # polling the engine's state, not waiting for an event
            if r.engine.scheduler.running:
                break
            await asyncio.sleep(0.005)
        async with s.post(base + "/reset_prefix_cache") as resp:
            assert (resp.status, await resp.json()) == (200, {"success": False})
        await task
        async with s.post(base + "/reset_prefix_cache") as resp:
            assert (resp.status, await resp.json()) == (200, {"success": True})


async def test_bound_publisher_numbers_batches_from_zero(start_replica, tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/events"
    r = await start_replica(kv_events_endpoint=endpoint, kv_events_topic="kv-events")
    sock = await subscribe(endpoint, b"kv-events")
    try:
        seqs = []
        for base in (1000, 2000):
            await complete(r.config.address, {"prompt": list(range(base, base + 9))})
            seqs += [seq for seq, _ in await receive(sock, "BlockStored")]
        assert seqs[0] == 0
        assert seqs == sorted(seqs)
        assert len(set(seqs)) >= 2
    finally:
        sock.close()
