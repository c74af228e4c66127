"""Prefill/decode in the simulator: a prefill replica hands its prompt KV over (NIXL parameters
or a shared-storage entry), a decode replica loads it instead of prefilling, and its metrics
count the load as external prefix-cache hits, as vLLM's do."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from epp.sim.kv_transfer import KVTransfer, KVTransferConfig
from epp.sim.request import SimRequest

from .test_server import post, sample, scrape

PROMPT = list(range(1, 30))  # 29 token ids: 7 full blocks of 4, the 8th partial


def counted(m: dict[str, Any], what: str) -> float:
    family = f"vllm:{what}"
    return sample(m, family, f"{family}_total")


async def test_nixl_prefill_hands_over_and_decode_loads(start_replica) -> None:
    nixl = KVTransferConfig("nixl")
    prefill = await start_replica(kv_transfer=nixl)
    decode = await start_replica(kv_transfer=nixl)
    status, _, first = await post(
        prefill,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 200
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["remote_block_ids"] == list(range(7))
    assert params["remote_port"] == prefill.config.port
    assert params["remote_num_tokens"] == 28
    status, _, second = await post(
        decode,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 5, "kv_transfer_params": params},
    )
    assert status == 200
    assert second["usage"]["completion_tokens"] == 5
    m = await scrape(decode)
    # Loaded, not found locally: the last prompt token is still computed.
    assert counted(m, "external_prefix_cache_hits") == 28
    assert counted(m, "external_prefix_cache_queries") == 29
    assert counted(m, "prefix_cache_hits") == 0
    # A request without parameters loads nothing.
    await post(decode, "/v1/completions", {"prompt": [7] * 20, "max_tokens": 1})
    m = await scrape(decode)
    assert counted(m, "external_prefix_cache_hits") == 28
    assert counted(m, "external_prefix_cache_queries") == 49


async def test_shared_storage_entry_is_found_by_another_replica(
    start_replica, tmp_path: Path
) -> None:
    shared = KVTransferConfig("shared-storage", str(tmp_path))
    prefill = await start_replica(kv_transfer=shared)
    decode = await start_replica(kv_transfer=shared)
    await post(decode, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    m = await scrape(decode)
    assert counted(m, "external_prefix_cache_hits") == 0  # nothing stored yet
    other = [p + 100 for p in PROMPT]
    status, _, first = await post(prefill, "/v1/completions", {"prompt": other, "max_tokens": 1})
    assert status == 200
    assert first["kv_transfer_params"] is None
    entries = await asyncio.to_thread(lambda: list(tmp_path.iterdir()))
    assert len(entries) == 2  # both prompts prefilled leave an entry
    await post(decode, "/v1/completions", {"prompt": other, "max_tokens": 3})
    m = await scrape(decode)
    assert counted(m, "external_prefix_cache_hits") == 28


def test_transfer_time_is_proportional_to_tokens_moved() -> None:
    transfer = KVTransfer(KVTransferConfig("nixl", bandwidth=1000.0), "h", 1, 4)
    assert transfer.seconds(500) == 0.5
    assert transfer.seconds(2000) == 2.0
    # Offers beyond the prompt's whole blocks, or malformed ones, load no more than they may.
    req = SimRequest("r", PROMPT, 1, 0.0)
    offer = {"do_remote_prefill": True, "remote_block_ids": list(range(50))}
    assert transfer.loadable(req, offer) == 28
    assert transfer.loadable(req, {"do_remote_prefill": True, "remote_block_ids": "x"}) == 0
    assert transfer.loadable(req, {"remote_block_ids": [1]}) == 0
