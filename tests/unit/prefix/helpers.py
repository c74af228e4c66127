"""Builders of vLLM KV-event messages and the captured real ones."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"


def captured(name: str = "kv_events") -> Iterator[dict[str, Any]]:
    """The lines of ``tests/fixtures/vllm/<name>.msgpack.jsonl``, frames decoded from base64."""
    with open(FIXTURES / f"{name}.msgpack.jsonl") as f:
        for line in f:
            record = json.loads(line)
            record["frames"] = [base64.b64decode(x) for x in record["frames_b64"]]
            yield record


def stored(
    hashes: Sequence[int],
    tokens: Sequence[int],
    parent: int | None = None,
    block_size: int = 4,
    lora: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A BlockStored event as vLLM 0.32 sends it."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": 1 if lora else None,
        "medium": "GPU",
        "lora_name": lora,
        "extra_keys": [[lora] if lora else None for _ in hashes],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        **extra,
    }


def removed(*hashes: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU", "group_idx": 0}


CLEARED = {"type": "AllBlocksCleared"}


def message(
    seq: int, *events: Any, topic: bytes = b"kv-events", payload: Any = None
) -> list[bytes]:
    """One 3-frame KV-event message; ``payload`` replaces the default ``[ts, events, 0]``."""
    body = [1795238500.5, list(events), 0] if payload is None else payload
    return [topic, seq.to_bytes(8, "big"), msgpack.packb(body)]
