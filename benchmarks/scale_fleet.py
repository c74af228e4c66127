"""A cheap fleet for the scale benchmark: many vLLM-shaped ``/metrics`` pages from one process.

Replica ``i`` listens on its own port, ``base_port + i`` on 127.0.0.1 (one port per replica,
not virtual hosts on one port: epp addresses a replica by ``host:port``, so each is a distinct
endpoint to it exactly as in a real pool). No model runs and no token is produced: each replica
only answers ``GET /metrics`` over kept-alive HTTP/1.1 with a page rendered once by the
simulator's vLLM metrics (:class:`epp.sim.metrics.EngineMetrics`), its queue and KV figures
drawn per replica. The waiting-queue line changes on every answer, so a scraper parses every
page as it would a busy replica's, and the fleet counts the pages each replica served.

Run as ``python -m benchmarks.scale_fleet --replicas N --base-port P``: it prints ``ready``
once every port listens, then answers each ``counts`` line on stdin with a JSON list of the
pages each replica has served so far, and stops at end of input.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import sys

from epp.sim.metrics import EngineMetrics

MODEL = "tiny"


def page_parts(rng: random.Random) -> tuple[bytes, bytes, bytes]:
    """A replica's page as (before, waiting line prefix, after): the queue length is spliced
    in per answer, so pages differ from scrape to scrape without re-rendering."""
    metrics = EngineMetrics(MODEL, {"block_size": "16", "num_gpu_blocks": "40000"}, 0, 4096)
    metrics.running.set(rng.randrange(32))
    metrics.kv_usage.set(rng.choice([0.2, 0.4, 0.6, 0.8]))
    metrics.waiting.set(-1)
    text = metrics.registry.render()
    marker = b"vllm:num_requests_waiting{"
    start = text.index(marker)
    end = text.index(b" -1", start)
    return text[:start], text[start : end + 1], text[end + 3 :]


class Replica(asyncio.Protocol):
    """One connection to replica ``index``: every request on it is answered with its page."""

    def __init__(self, fleet: Fleet, index: int) -> None:
        self._fleet = fleet
        self._index = index
        self._transport: asyncio.Transport | None = None
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            self._buffer = self._buffer[end + 4 :]
            assert self._transport is not None
            self._transport.write(self._fleet.answer(self._index))


class Fleet:
    def __init__(self, replicas: int, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.parts = [page_parts(rng) for _ in range(replicas)]
        self.counts = [0] * replicas

    def answer(self, index: int) -> bytes:
        self.counts[index] += 1
        before, waiting, after = self.parts[index]
        body = b"".join((before, waiting, str(self.counts[index] % 8).encode(), after))
        head = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n"
        return head.encode() + body

    async def serve(self, base_port: int) -> None:
        loop = asyncio.get_running_loop()
        servers = [
            await loop.create_server(
                functools.partial(Replica, self, i), "127.0.0.1", base_port + i, reuse_address=True
            )
            for i in range(len(self.counts))
        ]
        print("ready", flush=True)
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            if line.strip() == b"counts":
                print(json.dumps(self.counts), flush=True)
        for server in servers:
            server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--base-port", type=int, default=30000)
    args = parser.parse_args()
    asyncio.run(Fleet(args.replicas).serve(args.base_port))


if __name__ == "__main__":
    main()
