"""A replica that only streams: chat completions as vLLM writes them, a token every interval.

``/metrics`` answers an idle vLLM page; ``POST /v1/chat/completions`` streams ``--tokens`` chat
chunks ``--interval-ms`` apart, then the usage chunk when the request asked for it, then
``[DONE]``. Run: ``python -m benchmarks.stream_replica --port 8001``.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

METRICS = (
    'vllm:num_requests_running{model_name="stream"} 0.0\n'
    'vllm:num_requests_waiting{model_name="stream"} 0.0\n'
    'vllm:kv_cache_usage_perc{model_name="stream"} 0.0\n'
)


def chunk(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def app(tokens: int, interval: float) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": body["model"]}
        await resp.write(chunk({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        for i in range(tokens):
            await asyncio.sleep(interval)
            delta = {"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}
            await resp.write(chunk({**base, "choices": [delta]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": tokens + 8}
            await resp.write(chunk({**base, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    application = web.Application()
    application.router.add_get("/metrics", metrics)
    application.router.add_post("/v1/chat/completions", chat)
    return application


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--interval-ms", type=float, default=5.0)
    args = parser.parse_args()
    import uvloop

    uvloop.install()
    web.run_app(
        app(args.tokens, args.interval_ms / 1000),
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main()
