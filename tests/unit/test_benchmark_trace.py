"""--trace: replica queues polled over real HTTP while a stage runs, and every request's timing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks.loadgen import Outcome, StageRun
from benchmarks.trace import sum_samples, traced

PAGE = (
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {waiting}\n'
    'vllm:num_requests_running{{engine="0",model_name="tiny"}} 2.0\n'
    'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} 0.5\n'
    'vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {queries}\n'
    'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {hits}\n'
)


def test_sum_samples_adds_label_sets_and_ignores_others() -> None:
    page = (
        'vllm:request_success_total{finished_reason="stop"} 3.0\n'
        'vllm:request_success_total{finished_reason="length"} 4.0\n'
        "vllm:other 9\n"
    )
    assert sum_samples(page, ["vllm:request_success_total", "vllm:absent"]) == {
        "vllm:request_success_total": 7.0,
        "vllm:absent": 0.0,
    }


async def _replica(waiting: list[int], growth: int) -> TestServer:
    """A replica whose queue grows by ``growth`` on every scrape."""

    async def metrics(_: web.Request) -> web.Response:
        waiting[0] += growth
        # Every scrape, 1000 more prompt tokens queried, of which 250 * growth were cached.
        queries, hits = 1000 * waiting[0], 250 * growth * waiting[0]
        return web.Response(text=PAGE.format(waiting=waiting[0], queries=queries, hits=hits))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = TestServer(app)
    await server.start_server()
    return server


async def test_trace_polls_replicas_during_the_stage_and_records_each_request(
    tmp_path: Path,
) -> None:
    busy, idle = [0], [0]
    servers = [await _replica(busy, 1), await _replica(idle, 0)]
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    # A replica that is down must not stop the trace.
    down = "127.0.0.1:1"
    loop = asyncio.get_running_loop()

    async def stage() -> StageRun:
        t0 = loop.time()
        await asyncio.sleep(0.5)
        outcomes = [
            Outcome(ttft=0.1, output_tokens=8, started=t0, finished=t0 + 0.2),
            Outcome(ttft=0.4, output_tokens=8, started=t0 + 0.05, finished=t0 + 0.5),
            Outcome(error="HTTP 429: busy", started=t0 + 0.1, finished=t0 + 0.1),
        ]
        return StageRun(outcomes, 0.5, 0.0)

    path = tmp_path / "r" / "trace-24.jsonl"
    try:
        run, summary = await traced(
            stage(), [*addresses, down], ["conv-1", "conv-2", "conv-3"], path, interval=0.1
        )
    finally:
        for server in servers:
            await server.close()

    assert len(run.outcomes) == 3
    records = [json.loads(line) for line in path.read_text().splitlines()]
    samples = [r["replica_sample"] for r in records if "replica_sample" in r]
    requests = [r["request"] for r in records if "request" in r]
    by_replica = {a: [s for s in samples if s["replica"] == a] for a in addresses}
    # Polled repeatedly while the 0.5 s stage ran, in order, on the stage's clock.
    assert all(len(v) >= 3 for v in by_replica.values())
    assert [s["waiting"] for s in by_replica[addresses[0]]] == list(range(1, busy[0] + 1))
    assert by_replica[addresses[0]][0]["running"] == 2.0
    assert by_replica[addresses[0]][0]["kv"] == 0.5
    assert all(0.0 <= s["at"] <= 0.6 for s in samples)
    assert not [s for s in samples if s["replica"] == down]
    assert [r["key"] for r in requests] == ["conv-1", "conv-2", "conv-3"]
    assert [r["sent"] for r in requests] == [0.0, 0.05, 0.1]
    assert requests[1]["ttft"] == 0.4
    assert requests[1]["finished"] == 0.5
    assert requests[2]["error"] == "HTTP 429: busy"
    assert requests[2]["ttft"] is None
    # The summary names each replica's peak queue and the slowest first token.
    peaks = summary.split("peak waiting per replica ")[1].split(";")[0].split()
    assert sorted(float(p) for p in peaks) == [0.0, float(busy[0])]
    assert "slowest first token 0.40s (sent at 0.05s, conv-2)" in summary
    # Hit rates from the counters' growth: the busy replica's page says 25% of its tokens hit;
    # the idle one's counters never move.
    rates = summary.split("tokens queried per replica ")[1].split(";")[0].split()
    assert sorted(rates) == sorted(["-", f"25%/{(busy[0] - 1):.0f}k"])
