"""Readiness turns on once the endpoint list is published and each endpoint has been heard from
(a scrape answered or failed), so a fresh epp never answers 503 for endpoints it has not tried."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.devstack import free_port
from epp.extproc.health import EXT_PROC_SERVICE, Health
from epp.sources.scraper import MetricsScraper
from epp.state.memory import MemoryStore
from tests.unit.conftest import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
async def silent_replica() -> AsyncIterator[str]:
    """An address that accepts connections and never answers: no scrape can complete."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    port = free_port()
    server = await asyncio.start_server(hold, "127.0.0.1", port)
    yield f"127.0.0.1:{port}"
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


async def test_ready_once_every_endpoint_was_tried_even_if_it_failed(silent_replica: str) -> None:
    store = MemoryStore()
    await store.start()
    health = Health(store)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # A long first scrape (the silent replica never answers): readiness must wait for it.
    scraper = MetricsScraper(store, interval=0.05, timeout=2.0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(service: str) -> int:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                return int(reply.status)

            await health.start()
            assert await status("liveness") == SERVING
            assert await status("readiness") == NOT_SERVING  # no endpoint list yet
            assert await status(EXT_PROC_SERVICE) == NOT_SERVING

            scraper.set_endpoints({silent_replica: "main"})
            await scraper.start()
            await eventually(lambda: store.snapshot().endpoints, what="the endpoint published")
            await health.refresh()
            # Known, never tried to the end: an answer now could only be a 503.
            state = store.snapshot().endpoints[silent_replica]
            assert (state.scraped_at, state.failures) == (0.0, 0)
            assert await status("readiness") == NOT_SERVING

            await eventually(
                lambda: store.snapshot().endpoints[silent_replica].failures > 0,
                what="the first scrape timed out",
            )
            await health.refresh()
            assert await status("readiness") == SERVING
            assert await status(EXT_PROC_SERVICE) == SERVING
            # Still unready as a candidate: readiness only says every endpoint was tried.
            assert not store.snapshot().endpoints[silent_replica].ready
    finally:
        await scraper.stop()
        await server.stop(None)
        await store.stop()
