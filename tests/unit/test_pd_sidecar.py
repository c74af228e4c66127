"""The P/D sidecar over real HTTP: legs to a prefill and a decode engine (small recording
servers), the decode answer streamed back, refusals and the local fallback."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from epp.config import parse_config
from epp.discovery.spec import DnsSpec
from epp.pd.allowed import Allowed
from epp.pd.legs import decode_body, prefill_body
from epp.pd.sidecar import Sidecar, build_app

PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "e1",
    "remote_block_ids": [1, 2],
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
}


@dataclass
class Engine:
    """Records what it was sent; answers like vLLM (SSE when asked to stream)."""

    seen: list[tuple[str, dict[str, Any], dict[str, str]]] = field(default_factory=list)
    status: int = 200
    # False: answers like an engine without a KV connector (no transfer parameters).
    transfer: bool = True

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        data = json.loads(body) if body else {}
        self.seen.append((request.path, data, {k.lower(): v for k, v in request.headers.items()}))
        if request.path == "/metrics":
            return web.Response(text="vllm:num_requests_running 0\n")
        if self.status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.status)
        if data.get("stream"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            for i in range(3):
                await response.write(f'data: {{"choices":[{{"text":"t{i}"}}]}}\n\n'.encode())
            await response.write(b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n')
            await response.write(b"data: [DONE]\n\n")
            return response
        answer: dict[str, Any] = {"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}
        if self.transfer and data.get("kv_transfer_params", {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = PARAMS
        return web.json_response(answer)


async def serve(engine: Engine) -> TestServer:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine.handle)
    server = TestServer(app)
    await server.start_server()
    return server


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[Engine, Engine, TestServer, TestServer]]:
    prefill, decode = Engine(), Engine()
    p, d = await serve(prefill), await serve(decode)
    yield prefill, decode, p, d
    await p.close()
    await d.close()


async def sidecar_client(
    engine: TestServer, allowed: list[str], connector: str = "nixl"
) -> TestClient:
    sidecar = Sidecar(
        str(engine.make_url("")),
        Allowed(allowed),
        connector,
        prefill_timeout=2,  # type: ignore[arg-type]
    )
    client = TestClient(TestServer(build_app(sidecar, 1 << 20)))
    await client.start_server()
    return client


def address(server: TestServer) -> str:
    return f"{server.host}:{server.port}"


BODY = {
    "model": "tiny",
    "prompt": "long prompt",
    "max_tokens": 50,
    "stream": True,
    "stream_options": {"include_usage": True},
}


async def test_nixl_legs_and_the_decode_stream_comes_back_intact(fleet: Any) -> None:
    prefill, decode, p, d = fleet
    client = await sidecar_client(d, [address(p)])
    headers = {"x-prefiller-host-port": address(p), "x-request-id": "r-1"}
    response = await client.post("/v1/completions", json=BODY, headers=headers)
    text = await response.text()
    await client.close()
    assert response.status == 200
    assert text.count("data: ") == 5
    assert text.endswith("data: [DONE]\n\n")
    assert '"usage":{"completion_tokens":3}' in text
    ((_, first, first_headers),) = prefill.seen
    assert first["max_tokens"] == 1
    assert first["stream"] is False
    assert "stream_options" not in first
    assert first["kv_transfer_params"]["do_remote_decode"] is True
    assert first_headers["x-request-id"] == "r-1"
    ((_, second, second_headers),) = decode.seen
    assert second["kv_transfer_params"] == PARAMS
    assert second["max_tokens"] == 50
    assert second["stream"] is True
    assert second["stream_options"] == {"include_usage": True}
    assert second_headers["x-request-id"] == "r-1"
    assert "x-prefiller-host-port" not in second_headers


async def test_shared_storage_sends_the_same_body_without_transfer_params(fleet: Any) -> None:
    prefill, decode, p, d = fleet
    client = await sidecar_client(d, [address(p)], "shared-storage")
    body = {**BODY, "stream": False}
    response = await client.post(
        "/v1/chat/completions", json=body, headers={"x-prefiller-host-port": address(p)}
    )
    await client.close()
    assert response.status == 200
    assert "kv_transfer_params" not in prefill.seen[0][1]
    assert prefill.seen[0][1]["max_tokens"] == 1
    assert decode.seen[0][1] == body
    # A request id is made when the client sent none, the same on both legs.
    assert prefill.seen[0][2]["x-request-id"] == decode.seen[0][2]["x-request-id"]


async def test_a_target_outside_the_pool_is_refused(fleet: Any) -> None:
    prefill, decode, p, d = fleet
    client = await sidecar_client(d, ["10.9.9.9:8000"])
    response = await client.post(
        "/v1/completions", json=BODY, headers={"x-prefiller-host-port": address(p)}
    )
    error = await response.json()
    await client.close()
    assert response.status == 403
    assert error["error"]["type"] == "permission_error"
    assert prefill.seen == []
    assert decode.seen == []


@pytest.mark.parametrize("dead", ["down", "500", "no-params"])
async def test_a_failed_prefill_leg_falls_back_to_local_prefill(fleet: Any, dead: str) -> None:
    prefill, decode, p, d = fleet
    target = address(p)
    if dead == "down":
        await p.close()
    elif dead == "500":
        prefill.status = 500
    client = await sidecar_client(d, [target], "nixl")
    body = {**BODY, "stream": False}
    prefill.transfer = dead != "no-params"
    response = await client.post(
        "/v1/completions", json=body, headers={"x-prefiller-host-port": target}
    )
    await client.close()
    assert response.status == 200
    assert decode.seen[0][1] == body


async def test_everything_else_passes_through_without_client_transfer_params(
    fleet: Any,
) -> None:
    prefill, decode, p, d = fleet
    client = await sidecar_client(d, [address(p)])
    metrics = await client.get("/metrics")
    assert "vllm:num_requests_running" in await metrics.text()
    forged = {**BODY, "stream": False, "kv_transfer_params": {"do_remote_prefill": True}}
    response = await client.post("/v1/completions", json=forged)
    await client.close()
    assert response.status == 200
    assert "kv_transfer_params" not in decode.seen[-1][1]
    assert prefill.seen == []


def test_allowed_reads_prefill_endpoints_from_an_epp_configuration() -> None:
    config = parse_config(
        {
            "models": {"m": {"pools": ["main"]}},
            "pools": {
                "main": {
                    "endpoints": [
                        {"address": "10.0.0.1:8000", "role": "prefill"},
                        {"address": "10.0.0.2:8000", "role": "decode"},
                    ]
                }
            },
        }
    )
    allowed = Allowed(["10.0.0.5:8000"], config)
    assert "10.0.0.1:8000" in allowed
    assert "10.0.0.5:8000" in allowed
    assert "10.0.0.2:8000" not in allowed


async def test_allowed_follows_a_name() -> None:
    allowed = Allowed(names=[DnsSpec("localhost", 8000, role="prefill")])
    assert "127.0.0.1:8000" not in allowed
    await allowed.refresh()
    assert "127.0.0.1:8000" in allowed
    assert "127.0.0.1:8001" not in allowed


def test_leg_bodies() -> None:
    data = {
        "model": "m",
        "messages": [],
        "max_completion_tokens": 9,
        "stream": True,
        "kv_transfer_params": {"remote_host": "evil"},
    }
    first = prefill_body(data, "nixl")
    assert first["max_tokens"] == 1
    assert first["max_completion_tokens"] == 1
    assert first["kv_transfer_params"]["remote_host"] is None
    assert decode_body(data, "nixl", {"kv_transfer_params": PARAMS}) == {
        **{k: v for k, v in data.items() if k != "kv_transfer_params"},
        "kv_transfer_params": PARAMS,
    }
    assert decode_body(data, "nixl", {"kv_transfer_params": {"remote_host": "h"}}) is None
    assert "kv_transfer_params" not in (decode_body(data, "shared-storage", None) or {})
