"""Admission driven by objectives (epp.admission.objectives): lower-priority work is released
only while the latency model predicts a higher priority's next arrival would still meet its
target on some replica with a free decode slot; no request count to guess."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import pytest

from epp.admission.objectives import DEFAULT_FACTOR, Headroom, Objectives, Protected
from epp.config import parse_config
from epp.router import Router
from epp.state import EndpointMetrics, EndpointState
from epp.state.fleet import FleetState
from epp.state.inflight import Load
from epp.state.latency import TOKENS_UNIT
from epp.state.memory import MemoryStore

A, B = "127.0.0.1:8001", "127.0.0.1:8002"


def _predict(address: str, features: Sequence[float], now: float) -> float:
    """A replica that prefills 1000 tokens a second, its own and those queued ahead."""
    return 0.05 + features[1] + features[2]


def _endpoint(address: str, running: int = 0, kv: float = 0.0) -> EndpointState:
    metrics = EndpointMetrics(running=running, kv_usage=kv, block_size=16, num_gpu_blocks=301)
    return EndpointState(address, "main", True, metrics, time.time())


def test_objectives_protect_every_priority_above_the_lowest_with_its_tightest_target() -> None:
    built = Objectives.build(
        {"chat": 10, "voice": 10, "default": 0, "batch": -1},
        {"chat": 2.0, "voice": 0.5, "default": None},
    )
    assert built.protected == (Protected(10, 0.5), Protected(0, None))
    assert built.above(-1) == built.protected
    assert built.above(0) == (Protected(10, 0.5),)
    assert built.above(10) == ()
    assert Objectives.build({"only": 10}, {"only": 1.0}) == Objectives()


def test_batch_is_released_while_critical_would_still_meet_its_target() -> None:
    room = Headroom(_predict)
    configured = frozenset({10, -1})
    room.arrived(10, 500, configured, 0.0)  # critical prompts: 500 tokens (0.5 s to prefill)
    room.arrived(-1, 400, configured, 0.0)
    objectives = Objectives((Protected(10, 1.5),), configured)
    loads = {A: Load(), B: Load()}
    endpoints = [_endpoint(A), _endpoint(B)]
    assert room.allows(-1, objectives, endpoints, loads.__getitem__, 0.0)
    # A has 900 prefill tokens queued: critical would take 0.05 + 0.5 + 0.9 + 0.4 > 1.5 there,
    # but B is idle.
    loads[A] = Load(2, 2000, 900, 2)
    assert room.allows(-1, objectives, endpoints, loads.__getitem__, 0.0)
    loads[B] = Load(1, 1000, 700, 1)  # 0.05 + 0.5 + 0.7 + 0.4 > 1.5 on B too: batch waits
    assert not room.allows(-1, objectives, endpoints, loads.__getitem__, 0.0)
    # Critical itself has nothing above it to protect.
    assert room.allows(10, objectives, endpoints, loads.__getitem__, 0.0)


def test_without_a_target_the_default_is_a_multiple_of_the_idle_prediction() -> None:
    room = Headroom(_predict)
    configured = frozenset({10, -1})
    room.arrived(10, 1000, configured, 0.0)
    room.arrived(-1, 100, configured, 0.0)
    objectives = Objectives((Protected(10, None),), configured)
    idle = 0.05 + 1000 / TOKENS_UNIT
    queued = (DEFAULT_FACTOR - 1) * idle  # seconds of prefill the target leaves ahead of it
    endpoint = [_endpoint(A)]
    room_left = round(queued * TOKENS_UNIT) - 100 - 10
    assert room.allows(-1, objectives, endpoint, lambda _: Load(1, 0, room_left, 1), 0.0)
    too_much = round(queued * TOKENS_UNIT)
    assert not room.allows(-1, objectives, endpoint, lambda _: Load(1, 0, too_much, 1), 0.0)


def test_a_replica_keeps_a_decode_slot_from_its_kv_capacity() -> None:
    room = Headroom(_predict)
    objectives = Objectives((Protected(10, 10.0),), frozenset({10, -1}))
    # 300 blocks of 16 tokens; 4 running requests hold 60% of it: 720 tokens each, 6.7 slots.
    endpoint = _endpoint(A, running=4, kv=0.6)
    assert room.free_slots(endpoint, Load(4)) == pytest.approx(300 * 16 / 720 - 4)
    assert room.allows(-1, objectives, [endpoint], lambda _: Load(4), 0.0)
    # epp has 5 in flight there (one not yet running): releasing one more leaves no slot.
    assert not room.allows(-1, objectives, [endpoint], lambda _: Load(5), 0.0)
    # Unknown cache geometry: no slot limit, the prediction alone decides.
    assert room.free_slots(EndpointState(B, "main"), Load(50)) == float("inf")


def test_busier_higher_priorities_keep_more_slots_free() -> None:
    """Room for the arrivals expected within the target, not just the next one."""
    room = Headroom(_predict)
    configured = frozenset({10, -1})
    objectives = Objectives((Protected(10, 0.5),), configured)
    for i in range(80):  # 8/s for 10 s: the measured rate has climbed to about 5/s
        room.arrived(10, 100, configured, i / 8)
    assert room.rate(10, 10.0) == pytest.approx(8 * (1 - math.exp(-1)), rel=0.1)
    # 3 arrivals expected within 0.5 s, and the released request: 4 slots. The replica
    # holds 6.7 (720 KV tokens per running request).
    endpoint = _endpoint(A, running=1, kv=0.15)
    assert room.allows(-1, objectives, [endpoint], lambda _: Load(0), 10.0)
    assert not room.allows(-1, objectives, [endpoint], lambda _: Load(3), 10.0)
    # Quiet for a minute: the rate decays, room for the next arrival is enough again.
    assert room.allows(-1, objectives, [endpoint], lambda _: Load(3), 70.0)


def test_room_tables_stay_bounded() -> None:
    room = Headroom(_predict)
    for priority in range(1000):
        room.arrived(priority, 10, frozenset({10, -1}), 0.0)
    room.arrived(10, 10, frozenset({10, -1}), 0.0)
    room.arrived(5, 10, frozenset({5, -1}), 0.0)  # reloaded: 10 is no longer configured
    assert set(room._prompt) == set(room._rate) == {5}
    room.free_slots(_endpoint(A, running=1, kv=0.1), Load())
    room.forget([B])
    assert room._per_request == {}


async def _router(admission: dict[str, object]) -> Router:
    config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": [A, B]}},
            "admission": {"mode": "queue", **admission},
            "request": {"objectives": {"critical": {"priority": 10, "ttft_ms": 1000}, "batch": -1}},
        }
    )
    store = MemoryStore()
    for address in (A, B):
        await store.put_endpoint(_endpoint(address))
    return Router(config, FleetState(store))


async def test_the_pool_is_saturated_for_batch_once_queued_prefill_would_miss_the_target() -> None:
    router = await _router({})
    assert router.room.learned().protected == (Protected(10, 1.0),)
    assert not router.room.saturated("tiny", -1)
    # Both replicas have 20 000 prefill tokens queued (the latency model's prior: seconds).
    for address in (A, B):
        router.fleet.inflight.add(address, 20_000, 20_000)
    assert router.room.saturated("tiny", -1)
    assert not router.room.saturated("tiny", 10)  # critical still goes (nothing above it)
    # With an explicit limit, the counts decide as before, whatever the predictions.
    limited = await _router({"max_requests": 4})
    assert limited.room.learned() == Objectives()
    for address in (A, B):
        limited.fleet.inflight.add(address, 20_000, 20_000)
    assert not limited.room.saturated("tiny", -1)


async def test_learned_room_measures_the_kv_cache_in_decode_slots_not_a_threshold() -> None:
    """KV use over kv_threshold (0.8) fills a replica for the count-based detector; with
    objectives the highest priority is never held for KV (the slots kept for it hold batch
    back instead), batch is held once no slots are left, and routing keeps work on replicas
    with a free slot."""
    # 10 running requests hold 85% of 4800 tokens: 408 each, 11.8 slots, 1.8 free.
    roomy = _endpoint(A, running=10, kv=0.85)
    packed = _endpoint(B, running=11, kv=0.95)  # 415 each, 11.6 slots, 0.6 free
    for admission in ({}, {"max_requests": 100}):
        router = await _router(admission)
        for endpoint in (roomy, packed):
            await router.fleet.store.put_endpoint(endpoint)
        learned = not admission
        assert router.room.saturated("tiny", 10) is not learned
        kept = router.room.with_room([roomy, packed], 10, time.time())
        assert [c.address for c in kept] == ([A] if learned else [A, B])
    learned = await _router({})
    for address in (A, B):
        await learned.fleet.store.put_endpoint(_endpoint(address, running=11, kv=0.95))
    assert not learned.room.saturated("tiny", 10)
    assert learned.room.saturated("tiny", -1)
