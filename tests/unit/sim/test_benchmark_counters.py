"""The routing benchmark reads an SGLang-mode replica's counters under vLLM's names."""

from __future__ import annotations

import asyncio

import aiohttp

from benchmarks.routing import replica_counters

from .conftest import ReplicaFactory


async def test_sglang_replicas_are_counted_under_the_vllm_names(
    start_replica: ReplicaFactory,
) -> None:
    r = await start_replica(speaks="sglang")
    body = {"model": "tiny", "prompt": "hello hello hello", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(f"http://{r.config.address}/v1/completions", json=body) as resp:
                assert resp.status == 200
    (counters,) = (await asyncio.to_thread(replica_counters, [r.config.address], "sglang")).values()
    assert counters["vllm:request_success_total"] == 2
    assert counters["vllm:prefix_cache_queries_total"] > 0
    assert set(counters) == {
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
    }
