"""A stream finishes with the configuration it started with: a reload between its headers and
its body, or while flow control holds it, changes nothing for it; the next stream sees the new
configuration."""

from __future__ import annotations

import asyncio
import time

from epp._proto import ext_proc_pb2
from epp.config import Config, parse_config
from epp.extproc.stream import StreamHandler
from epp.router import Router
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from epp.state.snapshot import EndpointMetrics, EndpointState
from tests.unit.test_stream import FULL_DUPLEX, body_msg, destination, headers_msg

ENDPOINTS = ["127.0.0.1:8001", "127.0.0.1:8002"]


def _config(max_body_bytes: int, fallbacks: int, mode: str = "shed") -> Config:
    return parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ENDPOINTS}},
            "routing": {"fallbacks": fallbacks, "max_body_bytes": max_body_bytes},
            "admission": {"mode": mode, "max_requests": 1, "queue_threshold": 100},
        }
    )


async def _router(mode: str = "shed") -> Router:
    store = MemoryStore()
    for addr in ENDPOINTS:
        await store.put_endpoint(EndpointState(addr, "main", True, EndpointMetrics(), time.time()))
    return Router(_config(10_000, 1, mode), FleetState(store))


def _body(size: int) -> bytes:
    prompt = "x" * (size - len(b'{"model":"tiny","prompt":""}'))
    body = ('{"model":"tiny","prompt":"' + prompt + '"}').encode()
    assert len(body) == size
    return body


def _status(answer: ext_proc_pb2.ProcessingResponse) -> int:
    return int(answer.immediate_response.status.code)


async def test_a_reload_between_headers_and_body_keeps_the_started_limit() -> None:
    router = await _router()
    handler = StreamHandler(router)
    handler.handle(headers_msg())
    # The body limit falls below this request's body after its headers were accepted.
    router.config = _config(max_body_bytes=1_000, fallbacks=0)
    (answer,) = handler.handle(body_msg(_body(5_000)))
    assert answer.WhichOneof("response") == "request_body"
    header, _ = destination(answer, "request_body")
    # Routed with the started configuration's fallback count too (1: two endpoints).
    assert len(header.split(",")) == 2
    # A stream opened after the reload reads the new limit.
    later = StreamHandler(router)
    later.handle(headers_msg())
    (refused,) = later.handle(body_msg(_body(5_000)))
    assert _status(refused) == 413


async def test_a_request_held_by_flow_control_is_routed_with_its_configuration() -> None:
    router = await _router(mode="queue")
    # Both endpoints full (max_requests 1 each): the pool is saturated, the request is held.
    busy = [router.fleet.inflight.add(addr, 0) for addr in ENDPOINTS]
    handler = StreamHandler(router)
    handler.handle(headers_msg(mode=FULL_DUPLEX))
    assert handler.handle(body_msg(_body(100))) == ()
    assert handler.pending is not None
    request = handler.pending.request
    held = asyncio.create_task(router.admit(handler.context, request))
    for _ in range(100):
        if router.flow.queued() == 1:
            break
        await asyncio.sleep(0)
    assert router.flow.queued() == 1
    # Reloaded while held: no fallbacks.
    router.config = _config(10_000, fallbacks=0, mode="queue")
    assert handler.context.generation.config.routing.fallbacks == 1
    # Room frees on both endpoints (the second release wakes the queue): the held request is
    # routed with its own stream's configuration, one fallback.
    router.fleet.inflight.release(busy[0])
    router.finish(busy[1])
    await asyncio.wait_for(held, 5)
    answers = handler.resume()
    header, _ = destination(answers[0], "request_headers")
    assert sorted(header.split(",")) == ENDPOINTS
    # Once it has finished, a stream opened after the reload is routed with none.
    assert handler.ticket is not None
    router.finish(handler.ticket)
    later = StreamHandler(router)
    later.handle(headers_msg())
    assert later.handle(body_msg(_body(100))) == ()
    assert later.pending is not None
    await router.admit(later.context, later.pending.request)
    (answer,) = later.resume()
    header, _ = destination(answer, "request_body")
    assert len(header.split(",")) == 1
