"""Saturation detection and shedding of sheddable requests with 429."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from epp.admission import SaturationDetector
from epp.config import parse_config
from epp.extproc.stream import StreamHandler
from epp.router import Router
from epp.state import EndpointMetrics, EndpointState
from epp.state.fleet import FleetState
from epp.state.inflight import Load
from epp.state.memory import MemoryStore
from tests.unit.test_stream import body_msg, headers_msg

NOW = 1000.0


def ep(waiting: int = 0, kv: float = 0.0, age: float = 0.0, ready: bool = True) -> EndpointState:
    return EndpointState("a", "p", ready, EndpointMetrics(waiting=waiting, kv_usage=kv), NOW - age)


@pytest.mark.parametrize(
    ("endpoint", "full"),
    [
        (ep(), False),
        (ep(waiting=5), True),
        (ep(kv=0.8), True),
        (ep(age=0.5), True),
        (ep(ready=False), True),
        (ep(waiting=4, kv=0.79, age=0.1), False),
    ],
)
def test_endpoint_full(endpoint: EndpointState, full: bool) -> None:
    assert SaturationDetector().endpoint_full(endpoint, NOW) is full


def test_pool_saturated_only_when_every_candidate_is_full() -> None:
    detector = SaturationDetector()
    assert not detector.saturated([ep(waiting=9), ep()], NOW)
    assert detector.saturated([ep(waiting=9), ep(kv=0.95)], NOW)


def test_stale_threshold_follows_scrape_interval() -> None:
    base = {"models": {"m": {"pools": ["p"]}}, "pools": {"p": {"endpoints": ["127.0.0.1:1"]}}}
    assert parse_config(base).admission.stale_seconds == 0.2
    slow = parse_config({**base, "scrape": {"interval": 1.0}})
    assert slow.admission.stale_seconds == 4.0


async def test_sheddable_request_gets_429_when_saturated_others_are_routed() -> None:
    config = parse_config(
        {
            "models": {"tiny": {"pools": ["p"]}},
            "pools": {"p": {"endpoints": ["127.0.0.1:1"]}},
            "request": {"trusted_headers": True},  # x-priority set by a gateway in front
        }
    )
    store = MemoryStore()
    busy = EndpointMetrics(waiting=20)
    await store.put_endpoint(EndpointState("127.0.0.1:1", "p", True, busy, time.time()))
    router = Router(config, FleetState(store))
    body = body_msg(json.dumps({"model": "tiny", "prompt": "x"}).encode())

    shed = StreamHandler(router)
    shed.handle(headers_msg(extra={"x-priority": "-1"}))
    (answer,) = shed.handle(body)
    assert answer.immediate_response.status.code == 429
    assert json.loads(answer.immediate_response.body)["error"]["type"] == "rate_limit_error"

    normal = StreamHandler(router)
    normal.handle(headers_msg())
    (answer,) = normal.handle(body)
    assert answer.WhichOneof("response") == "request_body"


def test_admission_section_is_read_and_validated() -> None:
    base = {"models": {"m": {"pools": ["p"]}}, "pools": {"p": {"endpoints": ["127.0.0.1:1"]}}}
    config = parse_config({**base, "admission": {"queue_threshold": 2, "kv_threshold": 0.9}})
    assert (config.admission.queue_threshold, config.admission.kv_threshold) == (2, 0.9)
    with pytest.raises(ValueError, match=r"admission\.kv_threshold"):
        parse_config({**base, "admission": {"kv_threshold": 1.5}})
    assert config.flow_control.scope == "group"
    local = parse_config({**base, "admission": {"mode": "queue", "scope": "local"}})
    assert local.flow_control.scope == "local"
    assert not Router(local, FleetState(MemoryStore())).flow.use_group
    with pytest.raises(ValueError, match=r"admission\.scope: must be one of group, local"):
        parse_config({**base, "admission": {"scope": "cluster"}})


def test_concurrency_limits_and_the_reserve_for_priority_at_least_zero() -> None:
    detector = SaturationDetector(max_requests=8, max_tokens=1000, sheddable_reserve=0.25)
    assert not detector.endpoint_full(ep(), NOW, Load(requests=7, tokens=10))
    assert detector.endpoint_full(ep(), NOW, Load(requests=8, tokens=10))
    assert detector.endpoint_full(ep(), NOW, Load(requests=1, tokens=1000))
    # Sheddable work sees the endpoint full at 6 of 8: two slots stay for priority >= 0.
    assert detector.endpoint_full(ep(), NOW, Load(requests=6, tokens=10), sheddable=True)
    assert not detector.endpoint_full(ep(), NOW, Load(requests=5, tokens=10), sheddable=True)
    # 0 turns a limit off.
    assert not SaturationDetector().endpoint_full(ep(), NOW, Load(requests=10_000, tokens=10**9))


def test_a_pool_reserve_lets_batch_fill_endpoints_while_the_pool_keeps_room() -> None:
    detector = SaturationDetector(max_requests=4, pool_reserve=2)
    a, b = (EndpointState(addr, "p", True, EndpointMetrics(), NOW) for addr in ("a", "b"))
    loads = {"a": Load(requests=4), "b": Load(requests=1)}

    def load(address: str) -> Load:
        return loads[address]

    # a is full to its whole limit (no per-endpoint share held back); b has 3 free slots.
    assert detector.room([a, b], NOW, load) == 3
    assert not detector.saturated([a, b], NOW, load, sheddable=True)
    loads["b"] = Load(requests=2)
    # Two slots left in the pool: they are the reserve, so batch waits and critical does not.
    assert detector.saturated([a, b], NOW, load, sheddable=True)
    assert not detector.saturated([a, b], NOW, load)
    # An endpoint that is full for critical work (stale metrics) offers no room to reserve.
    loads["b"] = Load(requests=0)
    assert not detector.saturated([a, b], NOW, load, sheddable=True)
    stale = dataclasses.replace(b, scraped_at=NOW - 60)
    assert detector.room([a, stale], NOW, load) == 0
    assert detector.saturated([a, stale], NOW, load, sheddable=True)


def test_pool_reserve_is_validated_and_needs_a_request_limit() -> None:
    base = {"models": {"m": {"pools": ["p"]}}, "pools": {"p": {"endpoints": ["127.0.0.1:1"]}}}
    config = parse_config({**base, "admission": {"max_requests": 6, "pool_reserve": 1}})
    assert config.admission.pool_reserve == 1
    with pytest.raises(ValueError, match=r"admission\.pool_reserve: needs admission\.max_requests"):
        parse_config({**base, "admission": {"pool_reserve": 1}})
    with pytest.raises(ValueError, match=r"admission\.pool_reserve: must be an integer >= 0"):
        parse_config({**base, "admission": {"max_requests": 6, "pool_reserve": -1}})
