"""vLLM KV cache events over ZMQ PUB (vllm/distributed/kv_events.py, ZmqEventPublisher).

Wire layout: 3 frames [topic, seq as uint64 big-endian, msgpack payload]; the payload is
[ts, [event, ...], data_parallel_rank]; events are maps tagged by "type". As in vLLM, the events
raised during one engine step go out as one batch when the step's compute is over (vLLM
publishes them from update_from_output), and events raised between steps (AllBlocksCleared
after /reset_prefix_cache) wait for the next step; seq counts batches from 0.

:class:`SGLangEventPublisher` speaks SGLang's variant of the same wire format instead
(``epp sim --engine sglang``; python/sglang/srt/disaggregation/kv_events.py and the radix
cache's event mixin, sgl-project/sglang): events are positional arrays tagged by their first
element (msgspec ``array_like``), one ``BlockStored`` per page, block hashes signed 64-bit,
no LoRA name, and the batch's third element is the attention data-parallel rank.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

MEDIUM = "GPU"


class KVEventPublisher:
    """Collects cache events (the BlockPool's listener) and publishes them in batches."""

    def __init__(
        self,
        endpoint: str,
        topic: str,
        block_size: int,
        lora_ids: dict[str, int],
        rank: int = 0,
    ) -> None:
        self.endpoint = endpoint
        # The data-parallel rank each batch names (its publisher binds the port plus the rank).
        self.rank = rank
        self.topic = topic.encode()
        self.block_size = block_size
        self.lora_ids = lora_ids
        self.pending: list[Any] = []
        self.outbox: list[list[bytes]] = []  # encoded batches not sent yet
        self.seq = 0
        self._sock: zmq.asyncio.Socket | None = None
        self._ready = asyncio.Event()

    def start(self) -> None:
        # One shared context (its I/O thread serves every replica of the process).
        self._sock = zmq.asyncio.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        # vLLM's rule: bind wildcard and local-transport endpoints, connect to anything else
        # (then the subscriber is the one that binds).
        if any(m in self.endpoint for m in ("*", "::")) or self.endpoint.startswith(
            ("ipc://", "inproc://")
        ):
            self._sock.bind(self.endpoint)
        else:
            self._sock.connect(self.endpoint)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # CacheEventListener
    def block_stored(
        self, hashes: list[int], parent: int | None, token_ids: list[int], lora: str | None
    ) -> None:
        # Field order is vLLM's struct order. extra_keys has one entry per block: the key
        # tuple mixed into that block's hash (the LoRA name here) or None.
        self._add(
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": token_ids,
                "block_size": self.block_size,
                "lora_id": self.lora_ids.get(lora) if lora else None,
                "medium": MEDIUM,
                "lora_name": lora,
                "extra_keys": [[lora] if lora else None for _ in hashes],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        )

    def block_removed(self, hashes: list[int]) -> None:
        self._add(
            {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM, "group_idx": 0}
        )

    def all_cleared(self) -> None:
        self._add({"type": "AllBlocksCleared"})

    def end_step(self) -> None:
        """Close the step's batch (if it has events) and wake the sender."""
        if self.pending:
            self.outbox.append(self.encode_batch())
            self._ready.set()

    def _add(self, event: Any) -> None:
        self.pending.append(event)

    def encode_batch(self) -> list[bytes]:
        """Take the pending events as one 3-frame message."""
        payload = msgpack.packb([time.time(), self.pending, self.rank])
        self.pending = []
        frames = [self.topic, self.seq.to_bytes(8, "big"), payload]
        self.seq += 1
        return frames

    async def run(self) -> None:
        """Send closed batches in order (the engine closes one per step)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            batches, self.outbox = self.outbox, []
            for frames in batches:
                if self._sock is not None:
                    await self._sock.send_multipart(frames)


class SGLangEventPublisher(KVEventPublisher):
    """The same events as SGLang's radix cache publishes them."""

    def block_stored(
        self, hashes: list[int], parent: int | None, token_ids: list[int], lora: str | None
    ) -> None:
        # SGLang: [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium],
        # one event per page, each naming the previous page as its parent. Its events carry no
        # adapter (lora_id is always None).
        size = self.block_size
        for i, block_hash in enumerate(hashes):
            self._add(
                [
                    "BlockStored",
                    [_signed(block_hash)],
                    None if parent is None else _signed(parent),
                    token_ids[i * size : (i + 1) * size],
                    size,
                    None,
                    MEDIUM,
                ]
            )
            parent = block_hash

    def block_removed(self, hashes: list[int]) -> None:
        for block_hash in hashes:
            self._add(["BlockRemoved", [_signed(block_hash)], MEDIUM])

    def all_cleared(self) -> None:
        self._add(["AllBlocksCleared"])


def _signed(block_hash: int) -> int:
    """SGLang's block hashes are int64 (the first 8 bytes of a SHA-256, signed)."""
    block_hash &= (1 << 64) - 1
    return block_hash - (1 << 64) if block_hash >= 1 << 63 else block_hash
