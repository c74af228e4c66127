"""Load generator for streamed chat completions: N concurrent clients for a duration.

Each client posts a streaming request (one connection per request), reads the response as it
arrives and notes when each token event (``data: {`` with content) reached it. Prints one JSON
line: requests and tokens per second, the gaps between token arrivals within a stream (the
inter-token latency the client sees) at p50 and p99 in ms, and failed requests.
Run: ``python -m benchmarks.stream_client --url http://127.0.0.1:8080 --concurrency 32``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from urllib.parse import urlsplit

TOKEN = b'"content":'


async def one(host: str, port: int, request: bytes, gaps: list[float]) -> int:
    """One streamed request; returns its token count, or -1 when it failed."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            return -1
        tokens = 0
        last = None
        finished = False
        tail = b""
        while True:
            data = await reader.read(65536)
            if not data:
                break
            now = time.perf_counter()
            # Events split across reads are counted once, where their end arrived.
            text = tail + data
            events = text.split(b"\n\n")
            tail = events.pop()
            for event in events:
                finished = finished or b"[DONE]" in event
                if TOKEN in event and b'"role"' not in event:
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    tokens += 1
        return tokens if finished else -1
    finally:
        writer.close()


async def run(url: str, concurrency: int, duration: float, model: str) -> dict[str, float]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "go"}], "stream": True}
    ).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body
    gaps: list[float] = []
    done = failed = tokens = 0
    deadline = time.perf_counter() + duration

    async def client() -> None:
        nonlocal done, failed, tokens
        while time.perf_counter() < deadline:
            try:
                count = await one(host, port, request, gaps)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                count = -1
            if count < 0:
                failed += 1
            else:
                done += 1
                tokens += count

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    cuts = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else [0.0] * 99
    return {
        "requests_per_s": done / elapsed,
        "tokens_per_s": tokens / elapsed,
        "itl_p50_ms": cuts[49] * 1000,
        "itl_p99_ms": cuts[98] * 1000,
        "failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--model", default="stream")
    args = parser.parse_args()
    import uvloop

    result = uvloop.run(run(args.url, args.concurrency, args.duration, args.model))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
