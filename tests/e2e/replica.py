"""A vLLM-like replica for response-path tests: streams SSE in tiny, separately flushed pieces.

The simulator writes each event whole; real engines behind proxies do not always, and an SSE
event split mid-line across TCP reads is what epp's response path must survive. This replica
writes its stream ``piece`` bytes at a time with a pause between writes, so Envoy reads (and
hands epp) the event split anywhere. It reports usage like vLLM (``stream_options.
include_usage``) and serves enough of a vLLM ``/metrics`` page for epp to call it ready.

It also answers with its own ``x-epp-scores`` header (:data:`OWN_SCORES`), as a replica behind
another epp would: what the client receives in that header must be this epp's or nothing.

Prompts steer it: one containing ``BREAK`` gets a 200, one token, and then a dropped connection
(a failure after the response began). Every request body it received is kept in ``received``,
its path and headers in ``requests``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web

from epp.devstack import free_port

# The x-epp-scores header the replica sends itself.
OWN_SCORES = '{"from":"the replica"}'
TOKENS = ("Once", " upon", " a", " time", " there", " was", " a", " router", ".")


class TrickleReplica:
    def __init__(
        self,
        piece: int = 7,
        pause: float = 0.002,
        first_token_delay: float = 0.1,
        token_pause: float = 0.0,
    ) -> None:
        self.port = free_port()
        self.piece = piece
        self.pause = pause
        self.first_token_delay = first_token_delay
        self.token_pause = token_pause
        self.received: list[dict[str, Any]] = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=10)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n")

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.requests.append((request.raw_path, {k.lower(): v for k, v in request.headers.items()}))
        prompt = str(body["messages"][-1]["content"])
        resp = web.StreamResponse(
            headers={
                "content-type": "text/event-stream",
                "x-served-by": self.address,
                "x-epp-scores": OWN_SCORES,
            }
        )
        await resp.prepare(request)

        def event(payload: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        def delta(content: str, role: bool = False) -> bytes:
            d: dict[str, Any] = (
                {"role": "assistant", "content": ""} if role else {"content": content}
            )
            return event({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d}]})

        await self._trickle(resp, delta("", role=True))
        await asyncio.sleep(self.first_token_delay)
        if "BREAK" in prompt:
            await resp.write(delta(TOKENS[0]))
            assert request.transport is not None
            request.transport.abort()  # the response began; now the replica fails
            return resp
        for t in TOKENS:
            await self._trickle(resp, delta(t))
            await asyncio.sleep(self.token_pause)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": len(prompt.split()),
                "completion_tokens": len(TOKENS),
                "total_tokens": len(prompt.split()) + len(TOKENS),
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            await self._trickle(resp, event({"choices": [], "usage": usage}))
        await self._trickle(resp, b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _trickle(self, resp: web.StreamResponse, data: bytes) -> None:
        for i in range(0, len(data), self.piece):
            await resp.write(data[i : i + self.piece])
            await asyncio.sleep(self.pause)
