"""A simulated replica with several data-parallel engines: one page labelled per engine, one KV
publisher per rank, the rank a request names (or the least loaded) serving it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from epp.sources.sglang_metrics import parse_sglang_metrics
from epp.sources.vllm_metrics import parse_vllm_metrics
from tests.unit.conftest import eventually

from .conftest import ReplicaFactory, engine_config
from .test_kv_events import subscribe


async def _post(
    address: str, headers: dict[str, str], body: dict[str, Any] | None = None
) -> tuple[int, str | None]:
    body = body or {"prompt": "hello there", "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://{address}/v1/completions", json=body, headers=headers) as r,
    ):
        await r.read()
        return r.status, r.headers.get("x-served-rank")


async def _page(address: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"http://{address}/metrics") as r:
        return await r.text()


async def test_named_ranks_serve_and_the_page_shows_each_engine(
    start_replica: ReplicaFactory,
) -> None:
    r = await start_replica(data_parallel_size=2)
    host, port = r.config.host, r.config.port
    assert await _post(r.config.address, {"x-data-parallel-rank": "1"}) == (200, "1")
    assert await _post(r.config.address, {"x-data-parallel-host-port": f"{host}:{port}"}) == (
        200,
        "0",
    )
    for bad in ({"x-data-parallel-rank": "2"}, {"x-data-parallel-host-port": f"{host}:{port - 1}"}):
        assert (await _post(r.config.address, bad))[0] == 400
    page = await _page(r.config.address)
    # One family header, a series per engine; each request counted on its own engine.
    assert page.count("# TYPE vllm:num_requests_running gauge") == 1
    success = [line for line in page.splitlines() if line.startswith("vllm:request_success_total")]
    assert {('engine="0"' in s, s.endswith(" 1.0")) for s in success if "length" in s} == {
        (True, True),
        (False, True),
    }
    assert parse_vllm_metrics(page, 1).block_size == 4


async def test_without_a_rank_the_least_loaded_engine_serves(start_replica: ReplicaFactory) -> None:
    r = await start_replica(engine=engine_config(time_scale=1.0), data_parallel_size=2)
    r.engines[0].pause()  # rank 0 holds its queue: new work must go to rank 1
    held = asyncio.create_task(_post(r.config.address, {"x-data-parallel-rank": "0"}))
    await eventually(lambda: len(r.engines[0].scheduler.waiting) == 1, what="rank 0 queued")
    assert await _post(r.config.address, {}) == (200, "1")
    r.engines[0].resume()
    assert await held == (200, "0")


async def test_each_rank_publishes_at_its_port_and_names_itself(
    start_replica: ReplicaFactory, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/events"
    r = await start_replica(data_parallel_size=2, kv_events_endpoint=endpoint)
    sock = await subscribe(f"{endpoint}_dp1", b"kv-events")
    try:
        await _post(r.config.address, {"x-data-parallel-rank": "1"}, {"prompt": list(range(1, 18))})
        _, _, payload = await asyncio.wait_for(sock.recv_multipart(), 5)
        _, events, rank = msgpack.unpackb(payload)
        assert rank == 1
        assert events[0]["type"] == "BlockStored"
    finally:
        sock.close(linger=0)


async def test_sglang_mode_labels_each_scheduler_with_its_dp_rank(
    start_replica: ReplicaFactory,
) -> None:
    r = await start_replica(data_parallel_size=2, speaks="sglang")
    assert await _post(r.config.address, {"x-data-parallel-rank": "1"}) == (200, "1")
    page = await _page(r.config.address)
    assert page.count("# TYPE sglang:num_running_reqs gauge") == 1
    assert parse_sglang_metrics(page, 1).running == 0
    assert parse_sglang_metrics(page, 0).running == 0
    with pytest.raises(ValueError, match="num_running_reqs"):
        parse_sglang_metrics(page, 2)
