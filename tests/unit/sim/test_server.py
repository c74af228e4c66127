"""HTTP surface against real listening replicas: OpenAI formats (parsed like a client would),
/tokenize, /metrics, admin faults, sglang-router probes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.sim.replica import Replica
from epp.sim.request import SimRequest
from epp.sim.server import next_tokens
from tests.unit.conftest import eventually

from .conftest import engine_config


def url(replica: Replica, path: str) -> str:
    return f"http://{replica.config.address}{path}"


async def post(replica: Replica, path: str, body: Any) -> tuple[int, dict[str, Any], Any]:
    async with aiohttp.ClientSession() as s, s.post(url(replica, path), json=body) as r:
        return r.status, dict(r.headers), await r.json()


async def sse_events(replica: Replica, path: str, body: dict[str, Any]) -> list[Any]:
    """Read an SSE stream line by line as the OpenAI client does; [DONE] must end it."""
    events: list[Any] = []
    async with aiohttp.ClientSession() as s, s.post(url(replica, path), json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.pop() == "[DONE]"
    return events


async def scrape(replica: Replica) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url(replica, "/metrics")) as r:
        text = await r.text()
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], family: str, name: str | None = None) -> float:
    (s,) = [s for s in families[family].samples if s.name == (name or family)]
    return s.value


async def test_completion_returns_max_tokens_and_usage(start_replica) -> None:
    r = await start_replica()
    status, headers, body = await post(
        r, "/v1/completions", {"model": "tiny", "prompt": "def f(x):", "max_tokens": 7}
    )
    assert status == 200
    assert headers["x-served-by"] == r.config.address
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"]
    prompt_tokens = len(r.tokenizer.encode("def f(x):"))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 7,
        "completion_tokens": 7,
        "prompt_tokens_details": None,
    }


async def test_chat_stream_is_openai_sse_with_usage_chunk(start_replica) -> None:
    # Real-time steps (~3 ms): the client keeps up, so each token gets its own chunk.
    r = await start_replica(engine=engine_config(time_scale=1.0))
    messages = [{"role": "user", "content": "hello"}]
    events = await sse_events(
        r,
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": messages,
            "max_completion_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [e["choices"][0] for e in events[1:-1]]
    assert len(content) == 4
    assert [c["finish_reason"] for c in content] == [None, None, None, "length"]
    usage_chunk = events[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert usage_chunk["usage"]["prompt_tokens"] == len(r.tokenizer.encode_chat(messages))
    assert all("usage" not in e for e in events[:-1])


async def test_completion_stream_without_usage_ends_with_done(start_replica) -> None:
    r = await start_replica(engine=engine_config(time_scale=1.0))
    events = await sse_events(
        r, "/v1/completions", {"prompt": "x = 1", "max_tokens": 3, "stream": True}
    )
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]
    assert all("usage" not in e for e in events)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "other", "prompt": "x"}, 404, "model"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": 5}, 400, "prompt"),
        ({"prompt": [1, 99999]}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": 500}, 400, None),  # beyond max_model_len (200)
    ],
)
async def test_bad_requests_get_openai_errors(start_replica, body, status, param) -> None:
    r = await start_replica()
    code, _, err = await post(r, "/v1/completions", body)
    assert code == status
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["code"] == status
    assert err["error"]["param"] == param


async def test_tokenize_prompt_and_messages_in_vllm_format(start_replica) -> None:
    r = await start_replica()
    _, _, body = await post(r, "/tokenize", {"model": "tiny", "prompt": "hello world"})
    assert body == {
        "count": len(body["tokens"]),
        "max_model_len": 200,
        "tokens": r.tokenizer.encode("hello world"),
        "token_strs": None,
    }
    assert body["tokens"][0] == 0  # BOS added for prompts
    messages = [{"role": "user", "content": "hi"}]
    _, _, chat = await post(r, "/tokenize", {"model": "tiny", "messages": messages})
    assert chat["tokens"] == r.tokenizer.encode_chat(messages)
    assert chat["tokens"].count(0) == 1  # the template's BOS only, none added


async def test_metrics_use_vllm_names_labels_and_count_prefix_hits(start_replica) -> None:
    r = await start_replica()
    prompt = list(range(1, 30))  # token ids: 7 full blocks of 4
    for _ in range(2):
        status, _, _ = await post(r, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert status == 200
    m = await scrape(r)
    labels = {"engine": "0", "model_name": "tiny"}
    for family in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert m[family].type == "gauge"
        assert m[family].samples[0].labels == labels
    assert sample(m, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 58
    assert sample(m, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 28
    assert m["vllm:time_to_first_token_seconds"].type == "histogram"
    ttft_count = sample(
        m, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count"
    )
    assert ttft_count == 2
    for family in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert sample(m, family, f"{family}_count") == 2
    (info,) = m["vllm:cache_config_info"].samples
    assert info.value == 1
    assert info.labels["block_size"] == "4"
    assert info.labels["num_gpu_blocks"] == "64"
    assert info.labels["enable_prefix_caching"] == "True"
    assert sample(m, "vllm:num_preemptions", "vllm:num_preemptions_total") == 0
    assert sample(m, "vllm:kv_cache_usage_perc") == 0.0  # cached blocks are free
    assert "vllm:lora_requests_info" not in m or not m["vllm:lora_requests_info"].samples


async def test_hang_builds_a_queue_visible_in_metrics_then_drains(start_replica) -> None:
    r = await start_replica()
    status, _, faults = await post(r, "/admin/faults", {"hang": True})
    assert (status, faults["hang"]) == (200, True)
    tasks = [
        asyncio.create_task(post(r, "/v1/completions", {"prompt": "q", "max_tokens": 2}))
        for _ in range(3)
    ]
    await eventually(lambda: len(r.engine.scheduler.waiting) == 3, what="three requests queued")
    m = await scrape(r)
    assert sample(m, "vllm:num_requests_waiting") == 3
    assert not any(t.done() for t in tasks)
    await post(r, "/admin/faults", {"hang": False})
    results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert [s for s, _, _ in results] == [200, 200, 200]
    assert sample(await scrape(r), "vllm:num_requests_waiting") == 0


async def test_latency_and_error_faults(start_replica) -> None:
    r = await start_replica()
    async with aiohttp.ClientSession() as s, s.get(url(r, "/admin/faults")) as resp:
        assert await resp.json() == {"latency_ms": 0.0, "error_rate": 0.0, "hang": False}
    await post(r, "/admin/faults", {"latency_ms": 150})
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    status, _, _ = await post(r, "/v1/completions", {"prompt": "q", "max_tokens": 1})
    assert status == 200
    assert loop.time() - t0 >= 0.15
    await post(r, "/admin/faults", {"latency_ms": 0, "error_rate": 1.0})
    status, headers, err = await post(r, "/v1/completions", {"prompt": "q"})
    assert status == 500
    assert headers["x-served-by"] == r.config.address
    assert err["error"]["type"] == "InternalServerError"
    for bad in ({"error_rate": 2}, {"latency": 5}, {"crash": "yes"}):
        status, _, err = await post(r, "/admin/faults", bad)
        assert status == 400, bad


async def test_crash_drops_the_listener(start_replica) -> None:
    r = await start_replica()
    status, _, _ = await post(r, "/admin/faults", {"crash": True})
    assert status == 200
    await asyncio.sleep(0.2)
    with pytest.raises(aiohttp.ClientConnectionError):
        await post(r, "/v1/completions", {"prompt": "q"})


async def test_crash_resets_requests_in_flight_at_once(start_replica) -> None:
    """Requests held by a paused engine fail fast when the replica crashes, none hangs."""
    r = await start_replica()
    assert (await post(r, "/admin/faults", {"hang": True}))[0] == 200
    held = [
        asyncio.create_task(post(r, "/v1/completions", {"prompt": f"q{i}", "max_tokens": 4}))
        for i in range(3)
    ]
    await asyncio.sleep(0.1)
    assert (await post(r, "/admin/faults", {"crash": True}))[0] == 200
    # New connections keep arriving while the crash takes effect (50 ms after the call).
    for i in range(40):
        held.append(asyncio.create_task(post(r, "/v1/completions", {"prompt": f"late{i}"})))
        await asyncio.sleep(0.003)
    results = await asyncio.wait_for(asyncio.gather(*held, return_exceptions=True), 2.0)
    assert all(isinstance(x, aiohttp.ClientError) for x in results), results


async def test_models_health_and_router_probes(start_replica) -> None:
    r = await start_replica(
        lora_modules={"sql": "/adapters/sql"}, engine=engine_config(max_loras=1)
    )
    async with aiohttp.ClientSession() as s:
        async with s.get(url(r, "/health")) as resp:
            assert resp.status == 200
        async with s.get(url(r, "/v1/models")) as resp:
            models = await resp.json()
        async with s.get(url(r, "/get_server_info")) as resp:
            info = await resp.json()
        async with s.get(url(r, "/model_info")) as resp:
            model_info = await resp.json()
    assert [(m["id"], m["parent"]) for m in models["data"]] == [("tiny", None), ("sql", "tiny")]
    assert info["model_path"] == str(r.tokenizer.directory)
    assert model_info["tokenizer_path"] == str(r.tokenizer.directory)


async def test_lora_request_is_served_and_reported(start_replica) -> None:
    r = await start_replica(
        lora_modules={"sql": "/adapters/sql"}, engine=engine_config(max_loras=1)
    )
    status, _, body = await post(r, "/v1/completions", {"model": "sql", "prompt": "select"})
    assert (status, body["model"]) == (200, "sql")
    samples = (await scrape(r))["vllm:lora_requests_info"].samples
    assert {s.labels["max_lora"] for s in samples} == {"1"}
    latest = max(samples, key=lambda s: s.value)
    assert latest.labels["running_lora_adapters"] == ""
    assert any(s.labels["running_lora_adapters"] == "sql" for s in samples)


async def test_tokens_queued_while_the_writer_was_busy_are_merged() -> None:
    req = SimRequest("r", [1], 3, 0.0)
    for item in ([5], [6], [7], None):
        req.outputs.put_nowait(item)
    assert await next_tokens(req) == ([5, 6, 7], True)
    req = SimRequest("r", [1], 3, 0.0)
    req.outputs.put_nowait([5])
    assert await next_tokens(req) == ([5], False)


async def test_client_disconnect_aborts_the_request(start_replica) -> None:
    r = await start_replica(engine=engine_config(time_scale=1.0))
    body = {"prompt": "x", "max_tokens": 150, "stream": True}  # ~0.4 s of decoding
    async with aiohttp.ClientSession() as s, s.post(url(r, "/v1/completions"), json=body) as resp:
        await resp.content.readline()
        assert sample(await scrape(r), "vllm:num_requests_running") == 1
    await eventually(lambda: not r.engine.scheduler.has_work(), what="the request aborted")
    m = await scrape(r)
    assert sample(m, "vllm:num_requests_running") == 0
    assert sample(m, "vllm:kv_cache_usage_perc") == 0.0


async def test_metrics_labels_follow_vllms_exposition(start_replica) -> None:
    """Label names appear in vLLM's (sorted) order, and every finish reason vLLM pre-creates."""
    r = await start_replica()
    async with aiohttp.ClientSession() as s, s.get(url(r, "/metrics")) as resp:
        text = await resp.text()
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0' in text
    reasons = {
        s.labels["finished_reason"] for s in (await scrape(r))["vllm:request_success"].samples
    }
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    (info,) = (await scrape(r))["vllm:cache_config_info"].samples
    assert info.labels["prefix_caching_hash_algo"] == "sha256"
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    names = [kv.split("=")[0] for kv in line[line.index("{") + 1 : line.rindex("}")].split(",")]
    assert names == sorted(names)


async def test_lora_info_lists_an_adapter_in_flight_as_running_and_waiting(start_replica) -> None:
    """vLLM 0.32: absent before the first engine step; an adapter with a request in flight
    appears in both labels; no engine/model_name labels."""
    r = await start_replica(
        lora_modules={"sql": "/adapters/sql"}, engine=engine_config(max_loras=1, time_scale=1.0)
    )
    assert not (await scrape(r))["vllm:lora_requests_info"].samples
    task = asyncio.create_task(
        post(r, "/v1/completions", {"model": "sql", "prompt": [5] * 10, "max_tokens": 40})
    )
    # A step records the label set once the request runs; a busy machine can hold that step
    # up, so wait for a set naming an adapter rather than for a fixed time.
    for _ in range(1000):
        samples = (await scrape(r))["vllm:lora_requests_info"].samples
        latest = max(samples, key=lambda s: s.value, default=None)
        if latest is not None and latest.labels["running_lora_adapters"]:
            break
        await asyncio.sleep(0.005)
    assert latest is not None
    assert latest.labels == {
        "max_lora": "1",
        "running_lora_adapters": "sql",
        "waiting_lora_adapters": "sql",
    }
    await task
    latest = max((await scrape(r))["vllm:lora_requests_info"].samples, key=lambda s: s.value)
    assert latest.labels["running_lora_adapters"] == latest.labels["waiting_lora_adapters"] == ""


async def test_lora_blocks_hash_the_adapter_path_like_vllm(start_replica) -> None:
    """vLLM's LoRA extra key is ("lora", name, path): the same adapter name at another path
    must not share cached blocks."""
    from epp.sim.kv_cache import hash_blocks, lora_extra_keys

    r = await start_replica(
        lora_modules={"sql": "/adapters/sql"}, engine=engine_config(max_loras=1)
    )
    prompt = list(range(10, 30))
    await post(r, "/v1/completions", {"model": "sql", "prompt": prompt, "max_tokens": 1})
    expected = hash_blocks(prompt, 4, lora_extra_keys("sql", "/adapters/sql"))
    assert r.engine.kv.pool.lookup(expected)
    assert not r.engine.kv.pool.lookup(hash_blocks(prompt, 4, lora_extra_keys("sql", "/x")))


async def test_detokenize_keeps_special_tokens_and_models_match_vllm(start_replica) -> None:
    r = await start_replica(
        lora_modules={"sql": "/adapters/sql"}, engine=engine_config(max_loras=1)
    )
    status, _, body = await post(r, "/detokenize", {"tokens": [0, 3, 1000, 2000, 4]})
    assert (status, body) == (200, {"prompt": "<s><|im_start|>000warn<|im_end|>"})  # as vLLM
    async with aiohttp.ClientSession() as s, s.get(url(r, "/v1/models")) as resp:
        base, adapter = (await resp.json())["data"]
    assert base["max_model_len"] == 200
    assert adapter["max_model_len"] is None  # vLLM reports no length for an adapter
    assert adapter["root"] == "/adapters/sql"
    assert base["permission"][0]["object"] == "model_permission"


async def test_reset_running_requests_preempts_then_resets(start_replica) -> None:
    r = await start_replica(engine=engine_config(time_scale=1.0))
    task = asyncio.create_task(
        post(r, "/v1/completions", {"prompt": list(range(300, 340)), "max_tokens": 30})
    )
    for _ in range(200):
        if r.engine.scheduler.running:
            break
        await asyncio.sleep(0.005)
    status, _, body = await post(r, "/reset_prefix_cache?reset_running_requests=true", None)
    assert (status, body) == (200, {"success": True})
    status, _, done = await task  # the preempted request is recomputed and still finishes
    assert status == 200
    assert done["usage"]["completion_tokens"] == 30
    assert r.engine.scheduler.num_preemptions == 1


async def test_admin_headers_counts_what_inference_requests_arrived_with(start_replica) -> None:
    replica = await start_replica()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        for extra in ({"x-priority": "9"}, {}):
            async with s.post(url(replica, "/v1/completions"), json=body, headers=extra) as r:
                assert r.status == 200
        async with s.get(url(replica, "/metrics")) as r:  # not an inference route
            assert r.status == 200
        async with s.get(url(replica, "/admin/headers")) as r:
            seen = await r.json()
    assert seen["x-priority"] == 1
    assert seen["content-type"] == 2
    assert "accept-encoding" in seen
    assert all(v <= 2 for v in seen.values())
