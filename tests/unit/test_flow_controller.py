"""The flow controller on a real event loop: held until room frees, cancellation, refusals."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from prometheus_client import REGISTRY

from epp.admission.controller import FlowController
from epp.admission.flow_queue import BandLimits, QueueLimits
from epp.config import FlowControl, parse_config
from epp.errors import RequestError
from epp.lifecycle import RequestContext
from epp.request import InferenceRequest
from epp.router import Router
from epp.state.fleet import FleetState
from epp.state.health import Verdict
from epp.state.memory import MemoryStore
from epp.state.snapshot import EndpointMetrics, EndpointState
from tests.unit.test_stream import make_router


async def _until_queued(flow: FlowController, n: int) -> None:
    """Yield to the loop until ``n`` requests are held (the tasks run on the first yields)."""
    for _ in range(100):
        if flow.queued() == n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{flow.queued()} queued, expected {n}")


def _controller(full: list[bool], capacity: int = 10, ttl: float = 30.0) -> FlowController:
    return FlowController(
        QueueLimits(100, BandLimits(capacity, ttl)), lambda _key, _sheddable: full[0]
    )


async def test_a_request_is_held_while_saturated_and_released_on_wake() -> None:
    full = [True]
    flow = _controller(full)
    held = asyncio.create_task(flow.admit("m", 0, "f"))
    await _until_queued(flow, 1)
    # Several timer ticks pass: still saturated, so still held.
    await asyncio.sleep(0.02)
    assert not held.done()
    full[0] = False
    flow.wake()
    await asyncio.wait_for(held, 1)
    assert flow.queued() == 0


async def test_room_means_no_queueing() -> None:
    flow = _controller([False])
    await asyncio.wait_for(flow.admit("m", 0, "f"), 0.1)
    assert flow.queued() == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_is_never_released() -> None:
    full = [True]
    flow = _controller(full)
    leaver = asyncio.create_task(flow.admit("m", 0, "leaver"))
    stayer = asyncio.create_task(flow.admit("m", 0, "stayer"))
    await _until_queued(flow, 2)
    leaver.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaver
    assert flow.queued() == 1
    full[0] = False
    flow.wake()
    await asyncio.wait_for(stayer, 1)


async def test_full_band_is_429_and_ttl_is_503() -> None:
    flow = _controller([True], capacity=1, ttl=0.05)
    held = asyncio.create_task(flow.admit("m", 0, "f"))
    await _until_queued(flow, 1)
    with pytest.raises(RequestError) as refused:
        await flow.admit("m", 0, "f")
    assert refused.value.status == 429
    assert refused.value.headers["x-epp-request-dropped-reason"] == "rejected-saturated"
    with pytest.raises(RequestError) as expired:
        await asyncio.wait_for(held, 1)
    assert expired.value.status == 503
    assert int(expired.value.headers["retry-after"]) >= 1


def _dropped(reason: str) -> float:
    labels = {"inference_pool": "m", "reason": reason}
    return REGISTRY.get_sample_value("epp_flow_control_requests_dropped_total", labels) or 0.0


async def test_every_drop_is_counted_by_its_reason() -> None:
    before = {r: _dropped(r) for r in ("rejected-saturated", "rejected-ttl-expired")}
    flow = _controller([True], capacity=1, ttl=0.05)
    held = asyncio.create_task(flow.admit("m", 0, "f"))
    await _until_queued(flow, 1)
    with pytest.raises(RequestError):
        await flow.admit("m", 0, "f")
    with pytest.raises(RequestError):
        await asyncio.wait_for(held, 1)
    assert {r: _dropped(r) - n for r, n in before.items()} == {
        "rejected-saturated": 1,
        "rejected-ttl-expired": 1,
    }


async def test_a_request_held_for_an_empty_pool_asks_for_a_replica() -> None:
    """Scale from zero with flow control on: the held request is demand while it waits (it
    never reaches the scheduler, which counts the others)."""
    router = await make_router(ready=())
    router.config = dataclasses.replace(
        router.config, flow_control=FlowControl("queue", QueueLimits(10, BandLimits(10, 0.05)))
    )
    request = InferenceRequest("r", "/v1/completions", "completions", "tiny", "hi")
    held = asyncio.create_task(router.admit(RequestContext(router.generation), request))
    await _until_queued(router.flow, 1)
    assert router.demand.signal("main", ready=0).desired_replicas == 1
    # Still demand once the wait is over (no replica came): the TTL refuses it.
    with pytest.raises(RequestError) as expired:
        await asyncio.wait_for(held, 5)
    assert expired.value.status == 503
    assert router.demand.signal("main", ready=0).desired_replicas == 1


async def test_critical_goes_past_held_batch_while_there_is_room_for_it() -> None:
    # Saturated for sheddable work only (the reserve keeps room for priority >= 0).
    flow = FlowController(
        QueueLimits(100, BandLimits(10, 30.0)), lambda _key, priority: priority < 0
    )
    batch = asyncio.create_task(flow.admit("m", -1, "f"))
    await _until_queued(flow, 1)
    # Not queued behind the batch request, not even for one dispatch tick.
    critical = asyncio.create_task(flow.admit("m", 10, "f"))
    await asyncio.sleep(0)
    assert critical.done()
    assert flow.queued() == 1
    # An arrival of the held band's priority waits its turn (FIFO within the flow).
    same = asyncio.create_task(flow.admit("m", -1, "f"))
    await _until_queued(flow, 2)
    batch.cancel()
    same.cancel()
    await asyncio.gather(batch, same, return_exceptions=True)


async def _fresh_router(admission: dict[str, object]) -> Router:
    """Two ready endpoints with fresh metrics; 8002 scores better (a shorter queue)."""
    config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
            "admission": {"mode": "queue", "queue_threshold": 100, **admission},
        }
    )
    store = MemoryStore()
    for addr, waiting in (("127.0.0.1:8001", 10), ("127.0.0.1:8002", 0)):
        state = EndpointState(addr, "main", True, EndpointMetrics(waiting=waiting), time.time())
        await store.put_endpoint(state)
    return Router(config, FleetState(store))


async def test_a_released_request_goes_to_an_endpoint_with_room() -> None:
    """The pool has room (8001); scoring prefers 8002, which is full: routing must not send
    it there, or the dispatcher would see room forever and flood 8002 with the queue."""
    router = await _fresh_router({"max_requests": 1})
    router.fleet.inflight.add("127.0.0.1:8002", 10)
    assert not router.room.saturated("tiny")
    request = InferenceRequest("r", "/v1/completions", "completions", "tiny", "hi")
    decision, _ = router.route(request)
    assert decision.endpoints[0].address == "127.0.0.1:8001"
    assert router.room.saturated("tiny")


async def test_an_ejected_endpoint_has_no_room() -> None:
    """Passive health keeps requests off an ejected endpoint, so its free slots are none."""
    router = await _fresh_router({"max_requests": 1})
    router.fleet.inflight.add("127.0.0.1:8002", 10)
    ejected = Verdict("127.0.0.1:8001", "main", time.time() + 60, 1, "test")
    # The server configures health with each endpoint's pool: the ejection cap needs them.
    health = router.fleet.health
    health.configure(health.config, router.config.endpoint_pools())
    health.apply([ejected])
    assert router.room.saturated("tiny")


async def test_a_pool_reserve_keeps_the_last_slot_for_critical_wherever_it_is() -> None:
    router = await _fresh_router({"max_requests": 2, "pool_reserve": 1})
    router.fleet.inflight.add("127.0.0.1:8002", 10)
    router.fleet.inflight.add("127.0.0.1:8002", 10)
    # 8002 is full to its whole limit; 8001's two slots are room, one more than the reserve.
    assert not router.room.saturated("tiny", priority=-1)
    batch = InferenceRequest("b", "/v1/completions", "completions", "tiny", "hi", priority=-1)
    decision, _ = router.route(batch)
    assert decision.endpoints[0].address == "127.0.0.1:8001"
    # The last slot is the reserve: batch is held, critical still goes there.
    assert router.room.saturated("tiny", priority=-1)
    assert not router.room.saturated("tiny")
    critical = InferenceRequest("c", "/v1/completions", "completions", "tiny", "hi", priority=10)
    decision, _ = router.route(critical)
    assert decision.endpoints[0].address == "127.0.0.1:8001"
    assert router.room.saturated("tiny")
