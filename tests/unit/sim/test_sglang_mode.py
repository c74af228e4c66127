"""The simulator speaking SGLang (``epp sim --engine sglang``), scraped by epp's scraper."""

from __future__ import annotations

import argparse
import asyncio

from epp.sim.cli import add_arguments, build_configs
from epp.sources.scraper import MetricsScraper
from epp.state.memory import MemoryStore
from tests.unit.conftest import eventually

from .test_server import post, sample, scrape


async def test_metrics_use_sglangs_names_and_labels(start_replica) -> None:
    r = await start_replica(speaks="sglang")
    prompt = list(range(1, 30))  # 7 full blocks of 4
    for _ in range(2):
        status, _, _ = await post(r, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert status == 200
    m = await scrape(r)
    assert not any(name.startswith("vllm:") for name in m)
    ranks = {
        "model_name": "tiny",
        "engine_type": "unified",
        "tp_rank": "0",
        "pp_rank": "0",
        "moe_ep_rank": "0",
    }
    for family in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"):
        assert m[family].type == "gauge"
        assert m[family].samples[0].labels == ranks
    assert sample(m, "sglang:max_total_num_tokens") == 63 * 4
    assert sample(m, "sglang:prompt_tokens", "sglang:prompt_tokens_total") == 58
    # The second request found its first 28 tokens (7 blocks) cached.
    assert sample(m, "sglang:cached_tokens", "sglang:cached_tokens_total") == 28
    assert sample(m, "sglang:num_requests", "sglang:num_requests_total") == 2
    ttft = "sglang:time_to_first_token_seconds"
    assert sample(m, ttft, f"{ttft}_count") == 2
    assert m[ttft].samples[0].labels["model_name"] == "tiny"


async def test_a_queue_shows_in_sglang_names(start_replica) -> None:
    r = await start_replica(speaks="sglang")
    await post(r, "/admin/faults", {"hang": True})
    tasks = [
        asyncio.create_task(post(r, "/v1/completions", {"prompt": "q", "max_tokens": 2}))
        for _ in range(3)
    ]
    await eventually(
        lambda: r.engine.scheduler.waiting and len(r.engine.scheduler.waiting) == 3,
        what="three queued",
    )
    assert sample(await scrape(r), "sglang:num_queue_reqs") == 3
    await post(r, "/admin/faults", {"hang": False})
    await asyncio.wait_for(asyncio.gather(*tasks), 5)


async def test_epps_scraper_reads_an_sglang_pool_and_refuses_it_as_vllm(start_replica) -> None:
    r = await start_replica(speaks="sglang")
    await post(r, "/admin/faults", {"hang": True})
    tasks = [
        asyncio.create_task(post(r, "/v1/completions", {"prompt": "q", "max_tokens": 2}))
        for _ in range(2)
    ]
    store = MemoryStore()
    scraper = MetricsScraper(store, interval=0.02, failure_threshold=1)
    scraper.set_engines({"sg": "sglang"})
    scraper.set_endpoints({r.config.address: "sg"})
    await scraper.start()
    try:

        def waiting() -> int:
            state = store.snapshot().get(r.config.address)
            return state.metrics.waiting if state is not None and state.ready else -1

        await eventually(lambda: waiting() == 2, what="two waiting, read from SGLang's names")
        # The same replica in a pool that says nothing of its engine is read as vLLM: no page.
        scraper.set_engines({})
        await eventually(
            lambda: not store.snapshot().endpoints[r.config.address].ready,
            what="an SGLang page read as vLLM's fails",
        )
    finally:
        await scraper.stop()
        await post(r, "/admin/faults", {"hang": False})
        await asyncio.wait_for(asyncio.gather(*tasks), 5)


def test_the_cli_flag_selects_sglang() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--engine", "sglang", "--replicas", "2"])
    assert [c.speaks for c in build_configs(args)] == ["sglang", "sglang"]
    assert build_configs(parser.parse_args([]))[0].speaks == "vllm"
