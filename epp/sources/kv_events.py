"""Subscribe to every endpoint's vLLM KV-event publisher and keep the precise prefix index current.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``) BINDS a
ZMQ PUB socket and sends one 3-frame message per engine step that changed its prefix cache:
``[topic, seq (uint64 big-endian, 0 at engine start, +1 per message), msgpack payload]``.
We CONNECT one SUB socket per endpoint (ZMQ reconnects by itself, so a publisher that is down
or restarting just means no events for a while).

Accepted payload shapes (vLLM's ``vllm/distributed/kv_events.py`` across versions):

- the batch: ``[ts, [event, ...]]``, ``[ts, [event, ...], data_parallel_rank]`` or a map
  ``{"ts", "events", "data_parallel_rank"}``;
- an event: a map tagged by ``type`` (0.11+; fields whose value is None may be omitted) or a
  positional array tagged by its first element (msgspec ``array_like``, older releases), in
  declaration order: ``BlockStored: block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind``; ``BlockRemoved:
  block_hashes, medium, group_idx, kv_cache_spec_kind``; ``AllBlocksCleared`` (no fields).
  Trailing fields may be missing (older releases) or added (newer ones): both are fine.
- block hashes: uint64, or int64 from some producers (same bits), or bytes (releases that
  published raw digests; vLLM's integer form is the digest's last 8 bytes, used here too).

SGLang (``--kv-events-config``, same JSON) publishes the same wire format, read by the same
code: python/sglang/srt/disaggregation/kv_events.py (sgl-project/sglang commit
612d579090db24ec7c47cc5ca6b83e0c649b8c28, and later ones) defines ``[ts, [event, ...],
attn_dp_rank]`` batches of msgspec ``array_like`` tagged events whose fields are a prefix of
vLLM's: ``BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id`` then,
in later releases, ``medium`` (``GPU``, ``CPU_PINNED``, ``DISK``, ``EXTERNAL``); ``BlockRemoved:
block_hashes`` then ``medium``. Its radix cache sends one event per page with signed 64-bit
hashes (masked to the same bits here) and no adapter name. Two SGLang shapes are skipped, as
no request epp keys could match them: a ``BlockStored`` carrying a ``metadata`` map after
``medium`` (``BlockStoredWithMetadata``: blocks hashed with a ``cache_salt``) and pages whose
token ids are pairs (EAGLE's bigram keys).

Events that do not describe the GPU prefix cache of the main attention group (CPU offload
tiers, sliding-window groups of hybrid models) are skipped: their hashes would double-count.

Trust: a lost message may have carried removes, so after a sequence gap, a restart (the
sequence goes back: the engine restarted with an empty cache) or an undecodable message the
endpoint's entries are dropped and rebuilt from the next events; each case is counted in
``epp_kv_index_resets_total`` and logged once per endpoint. Nothing one endpoint sends can
stop another endpoint's subscription.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from epp.observability import (
    KV_EVENT_BATCHES,
    KV_INDEX_BLOCKS,
    KV_INDEX_RESETS,
    KV_UNKEYED_BLOCKS,
)
from epp.prefix.precise import PreciseIndex

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
# Positional layouts of msgspec array_like events, after the tag.
_STORED_FIELDS = (
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
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "kv_cache_spec_kind")
# Cache kinds whose blocks are the prompt prefix a request can hit (Dynamo's rule too).
_MAIN_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
# Seconds before re-creating a socket that failed (not a dead peer: ZMQ handles those).
_RETRY_SECONDS = 1.0


class MalformedMessage(ValueError):
    """A message that is not a vLLM KV-event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    # The adapter the blocks were computed under (None: base model).
    lora_name: str | None
    # Per block: what else the engine mixed into its hash (None: nothing).
    extra_keys: list[Any] | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: list[Event]
    # The data-parallel rank the batch says it comes from (None: the engine names none).
    rank: int | None = None


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """Decode one multipart message; raise :class:`MalformedMessage` if it is not one."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise MalformedMessage(
            f"expected [topic, 8-byte seq, payload], got {len(frames)} frames"
            + (f" with a {len(frames[1])}-byte seq" if len(frames) == 3 else "")
        )
    seq = int.from_bytes(frames[1], "big")
    try:
        payload = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise MalformedMessage(f"payload is not msgpack: {exc}") from None
    if isinstance(payload, dict):
        ts, raw_events = payload.get("ts"), payload.get("events")
        rank = payload.get("data_parallel_rank")
    elif isinstance(payload, list) and len(payload) >= 2:
        ts, raw_events = payload[0], payload[1]
        rank = payload[2] if len(payload) > 2 else None
    else:
        raise MalformedMessage(f"payload is not an event batch: {type(payload).__name__}")
    if not isinstance(ts, int | float) or not isinstance(raw_events, list):
        raise MalformedMessage("event batch needs a numeric ts and a list of events")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise MalformedMessage(f"data_parallel_rank must be an integer or null, got {rank!r:.40}")
    events = [e for e in map(decode_event, raw_events) if e is not None]
    return EventBatch(seq, float(ts), events, rank)


def decode_event(raw: Any) -> Event | None:
    """One event as a map or positional array; None for events that are not for us."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        layout = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(layout, raw[1:], strict=False))
    else:
        raise MalformedMessage(f"event is neither a map nor a tagged array: {raw!r:.80}")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        return None  # a newer event type: nothing we know how to apply
    if not _is_main_gpu_cache(fields):
        return None
    hashes = _hashes(fields.get("block_hashes"))
    if kind == "BlockRemoved":
        return BlockRemoved(hashes)
    if isinstance(fields.get("lora_name"), dict):
        return None  # SGLang's salted blocks: the salt is in their hash, not in our keys
    parent = fields.get("parent_block_hash")
    token_ids = fields.get("token_ids")
    block_size = fields.get("block_size")
    extra_keys = fields.get("extra_keys")
    if not isinstance(token_ids, list) or not isinstance(block_size, int):
        raise MalformedMessage("BlockStored needs token_ids and block_size")
    if token_ids and isinstance(token_ids[0], list):
        return None  # SGLang's bigram pages (EAGLE): keys of token pairs, not of a prompt
    if extra_keys is not None and not isinstance(extra_keys, list):
        raise MalformedMessage("BlockStored extra_keys must be a list")
    lora_name = fields.get("lora_name")
    lora_id = fields.get("lora_id")
    if lora_name is None and lora_id is not None:
        # Releases before lora_name say only the adapter's id, which no request carries: key
        # those blocks apart so they never match a base-model prompt with the same tokens.
        lora_name = f"\x00lora-id:{lora_id}"
    return BlockStored(
        hashes,
        None if parent is None else _hash(parent),
        token_ids,
        block_size,
        lora_name if isinstance(lora_name, str) else None,
        extra_keys,
    )


def _is_main_gpu_cache(fields: Mapping[str, Any]) -> bool:
    medium = fields.get("medium")
    if medium is not None and medium != "GPU":
        return False
    kind = fields.get("kv_cache_spec_kind")
    if kind is not None:
        return kind in _MAIN_KINDS
    return fields.get("group_idx") in (None, 0)


def _hashes(raw: Any) -> list[int]:
    if not isinstance(raw, list):
        raise MalformedMessage("block_hashes must be a list")
    return [_hash(h) for h in raw]


def _hash(raw: Any) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw & _MASK64
    if isinstance(raw, bytes):
        return int.from_bytes(raw[-8:], "big")
    raise MalformedMessage(f"block hash must be an integer or bytes, got {raw!r:.40}")


@dataclass
class _Stream:
    """Per-endpoint subscription state."""

    endpoint: str
    address: str
    # The data-parallel rank this endpoint is (epp.data_parallel): batches naming another rank
    # describe another engine's cache and are not applied.
    rank: int | None = None
    last_seq: int | None = None
    warned: set[str] = field(default_factory=set)
    task: asyncio.Task[None] | None = None


class KvEventSubscriber:
    """One ZMQ SUB per endpoint, applying its events to ``index`` on the event loop thread."""

    def __init__(
        self,
        index: PreciseIndex,
        topic: str = "",
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        # Prefix filter on the first frame; "" takes every topic (vLLM's default is "").
        self.topic = topic.encode()
        self._context = context
        self._wanted: dict[str, str] = {}
        self._ranks: Mapping[str, int] = {}
        self._streams: dict[str, _Stream] = {}
        self._started = False

    def set_endpoints(
        self, endpoints: Mapping[str, str], ranks: Mapping[str, int] | None = None
    ) -> None:
        """Subscribe to exactly ``endpoints`` (endpoint address -> ZMQ address) from now on;
        ``ranks``: the data-parallel rank of the endpoints that are one.

        Before :meth:`start` this only records the list. An endpoint removed, or whose ZMQ
        address or rank changed, loses its entries (they describe another publisher's cache).
        """
        self._wanted = dict(endpoints)
        self._ranks = dict(ranks or {})
        if self._started:
            self._reconcile()

    async def start(self) -> None:
        self._started = True
        self._reconcile()

    async def stop(self) -> None:
        self._started = False
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._streams.clear()

    def handle(self, endpoint: str, frames: Sequence[bytes]) -> None:
        """Apply one multipart message from ``endpoint``'s publisher. Never raises."""
        stream = self._streams.get(endpoint)
        if stream is None:
            stream = self._streams[endpoint] = _Stream(endpoint, "", self._ranks.get(endpoint))
        KV_EVENT_BATCHES.labels(endpoint).inc()
        try:
            batch = decode_message(frames)
        except MalformedMessage as exc:
            self._reset(stream, "malformed", str(exc))
            stream.last_seq = None  # whatever comes next cannot be checked against this one
            return
        if stream.rank is not None and batch.rank is not None and batch.rank != stream.rank:
            # A publisher of another rank at this address (a misconfigured port): its blocks
            # are not this rank's cache.
            self._reset(stream, "rank", f"batch of rank {batch.rank}, expected {stream.rank}")
            stream.last_seq = None
            return
        last = stream.last_seq
        if last is not None and batch.seq <= last:
            self._reset(stream, "restart", f"sequence went from {last} back to {batch.seq}")
        elif last is not None and batch.seq != last + 1:
            self._reset(stream, "gap", f"{batch.seq - last - 1} messages lost after {last}")
        stream.last_seq = batch.seq
        try:
            self._apply(endpoint, batch)
        # A batch the index cannot apply (inconsistent sizes, token ids that are no token ids)
        # may have been applied in part: the endpoint's entries are no longer trustworthy.
        except Exception as exc:
            self._reset(stream, "malformed", f"{type(exc).__name__}: {exc}")
        KV_INDEX_BLOCKS.labels(endpoint).set(self.index.block_count(endpoint))

    def _apply(self, endpoint: str, batch: EventBatch) -> None:
        index = self.index
        for event in batch.events:
            if isinstance(event, BlockStored):
                index.stored(
                    endpoint,
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    event.block_size,
                    event.lora_name,
                    event.extra_keys,
                )
            elif isinstance(event, BlockRemoved):
                index.removed(endpoint, event.block_hashes)
            else:
                # The engine's cache was reset (e.g. /reset_prefix_cache): routine, not logged.
                KV_INDEX_RESETS.labels(endpoint, "cleared").inc()
                index.drop(endpoint)

    def _reset(self, stream: _Stream, reason: str, detail: str) -> None:
        KV_INDEX_RESETS.labels(stream.endpoint, reason).inc()
        # Once per endpoint and reason at warning level: a flapping publisher must not flood.
        level = logging.DEBUG if reason in stream.warned else logging.WARNING
        stream.warned.add(reason)
        log.log(
            level,
            "KV events from %s: %s (%s); dropping its precise prefix entries",
            stream.endpoint,
            reason,
            detail,
        )
        self.index.drop(stream.endpoint)

    def _reconcile(self) -> None:
        for endpoint, stream in list(self._streams.items()):
            if (
                self._wanted.get(endpoint) != stream.address
                or self._ranks.get(endpoint) != stream.rank
            ):
                if stream.task is not None:
                    stream.task.cancel()
                del self._streams[endpoint]
                self.index.drop(endpoint)
                _forget_series(endpoint)
        for endpoint, address in self._wanted.items():
            if endpoint not in self._streams:
                stream = self._streams[endpoint] = _Stream(
                    endpoint, address, self._ranks.get(endpoint)
                )
                stream.task = asyncio.create_task(
                    self._run(stream), name=f"epp-kv-events-{endpoint}"
                )

    async def _run(self, stream: _Stream) -> None:
        context = self._context or zmq.asyncio.Context.instance()
        while True:
            sock = context.socket(zmq.SUB)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, self.topic)
                sock.connect(stream.address)
                log.info("subscribed to KV events of %s at %s", stream.endpoint, stream.address)
                while True:
                    self.handle(stream.endpoint, await sock.recv_multipart())
            except asyncio.CancelledError:
                raise
            # A socket-level failure (not a dead peer, which ZMQ rides out): start over.
            except Exception as exc:
                level = logging.DEBUG if "socket" in stream.warned else logging.WARNING
                stream.warned.add("socket")
                log.log(level, "KV-event socket for %s failed: %s", stream.endpoint, exc)
                stream.last_seq = None
                self.index.drop(stream.endpoint)
                await asyncio.sleep(_RETRY_SECONDS)
            finally:
                sock.close(linger=0)


def _forget_series(endpoint: str) -> None:
    """Drop a removed endpoint's label sets so dashboards do not show it forever."""
    KV_EVENT_BATCHES.remove(endpoint)
    KV_INDEX_BLOCKS.remove(endpoint)
    KV_UNKEYED_BLOCKS.remove(endpoint)
    for reason in ("gap", "restart", "malformed", "cleared", "overflow", "rank"):
        KV_INDEX_RESETS.remove(endpoint, reason)
