"""Latency targets: the latency-target-filter, the header, refusal and attainment."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from epp.config import ConfigError, parse_config
from epp.errors import RequestError
from epp.request import LatencyTarget
from epp.router import Router
from epp.scheduling.data import LATENCY_TARGET
from epp.scheduling.filters.latency_target import LatencyTargetFilter, LatencyTargetParams
from epp.scheduling.scorers.latency import PredictedLatencyScorer
from epp.state import EndpointMetrics, EndpointState
from epp.state.fleet import FleetState
from epp.state.inflight import Load
from epp.state.latency import Basis, ttft_features
from epp.state.memory import MemoryStore
from epp.state.moves import PickRecord
from epp.wire import SLO_TPOT_HEADER, SLO_TTFT_HEADER
from tests.unit.scheduling.common import cycle, ep, req

FAST, SLOW = "127.0.0.1:8001", "127.0.0.1:8002"


def teach(fleet: FleetState, now: float) -> None:
    """FAST prefills 20k tokens/s, SLOW 2k: a 1,000-token cold prompt takes ~0.06 s vs ~0.5 s.
    FAST decodes at 10 ms a token, SLOW at 40 ms."""
    for address, rate, tpot in ((FAST, 20_000.0, 0.01), (SLOW, 2_000.0, 0.04)):
        for i in range(40):
            uncached = 200.0 + 100 * i
            features = ttft_features(uncached, Load(), ep(address))
            seconds = 0.01 + uncached / rate
            at = now - 5 + i / 10
            fleet.latency.observe_ttft(address, Basis(features, 0.0), seconds, at)
            fleet.latency.observe_tpot(address, 1 + i % 4, tpot, at)


def decide(target: LatencyTarget | None, on_miss: str = "best") -> tuple[list[str], list[float]]:
    fleet = FleetState()
    teach(fleet, 1000.0)
    c = cycle(fleet)
    if target is not None:
        c.put(LATENCY_TARGET, target)
    request = req("x" * 4000)  # ~1,000 tokens
    candidates = [ep(FAST), ep(SLOW)]
    PredictedLatencyScorer().produce(request, candidates, c)
    plugin = LatencyTargetFilter(LatencyTargetParams(on_miss=on_miss))
    kept = plugin.filter(request, candidates, c)
    return [e.address for e in kept], list(plugin.score(request, kept, c))


def test_only_endpoints_predicted_to_meet_the_target_remain() -> None:
    assert decide(LatencyTarget(ttft=0.2))[0] == [FAST]
    assert decide(LatencyTarget(tpot=0.02))[0] == [FAST]
    # Both kinds must be met: SLOW makes the loose TTFT target but not the TPOT one.
    assert decide(LatencyTarget(ttft=1.0, tpot=0.02))[0] == [FAST]


def test_a_loose_target_prefers_the_endpoint_that_just_makes_it() -> None:
    for loose in (LatencyTarget(ttft=1.0), LatencyTarget(tpot=0.05)):
        kept, scores = decide(loose)
        assert kept == [FAST, SLOW]
        assert scores[1] > scores[0]  # SLOW wastes less headroom; FAST stays free


def test_missed_everywhere_keeps_all_or_refuses() -> None:
    for tight in (LatencyTarget(ttft=0.01), LatencyTarget(tpot=0.001)):
        assert decide(tight)[0] == [FAST, SLOW]
        assert decide(tight, on_miss="refuse")[0] == []
    assert decide(None, on_miss="refuse") == ([FAST, SLOW], [1.0, 1.0])


def _sample(result: str, objective: str = "", target: str = "ttft") -> float:
    value = REGISTRY.get_sample_value(
        "epp_latency_target_requests_total",
        {"objective": objective, "target": target, "result": result},
    )
    return value or 0.0


async def router(trusted: bool = True) -> Router:
    config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": [FAST, SLOW]}},
            "request": {
                "trusted_headers": trusted,
                "objectives": {
                    "chat": {"priority": 1, "ttft_ms": 300, "tpot_ms": 20},
                    "batch": -1,
                },
            },
            "scheduling": {
                "profile": "slo",
                "plugins": [
                    {
                        "name": "target",
                        "type": "latency-target-filter",
                        "parameters": {"on_miss": "refuse", "ttft_ms": 2000},
                    }
                ],
                "profiles": {
                    "slo": [
                        {"plugin": "predicted-latency-scorer", "weight": 1},
                        {"plugin": "target", "weight": 1},
                        {"plugin": "max-score-picker"},
                    ]
                },
            },
        }
    )
    store = MemoryStore()
    for address in (FAST, SLOW):
        await store.put_endpoint(EndpointState(address, "main", True, EndpointMetrics(), 1.0))
    fleet = FleetState(store)
    teach(fleet, time.time())
    return Router(config, fleet)


async def test_the_header_sets_the_target_and_attainment_is_counted() -> None:
    r = await router()
    request = req("x" * 4000, model="tiny", headers={SLO_TTFT_HEADER: "200"})
    decision, ticket = r.route(request)
    assert decision.endpoints[0].address == FAST
    assert ticket.basis is not None
    assert ticket.basis.target == LatencyTarget(ttft=pytest.approx(0.2))
    met = _sample("met")
    r.learning.first_token(PickRecord(ticket, picked_at=10.0), 10.1)
    assert _sample("met") == met + 1
    refused = _sample("refused")
    with pytest.raises(RequestError) as raised:
        r.route(req("x" * 4000, model="tiny", headers={SLO_TTFT_HEADER: "5"}))
    assert raised.value.status == 429
    assert raised.value.code == "latency_target_unreachable"
    assert _sample("refused") == refused + 1


async def test_untrusted_callers_get_the_profiles_target() -> None:
    r = await router(trusted=False)
    _, ticket = r.route(req("x" * 4000, model="tiny", headers={SLO_TTFT_HEADER: "5"}))
    assert ticket.basis is not None
    assert ticket.basis.target == LatencyTarget(ttft=pytest.approx(2.0))


async def test_objectives_set_targets_headers_override_them_kind_by_kind() -> None:
    r = await router()
    _, ticket = r.route(req("x" * 4000, model="tiny", objective="chat"))
    assert ticket.basis is not None
    assert ticket.basis.target == LatencyTarget(pytest.approx(0.3), pytest.approx(0.02))
    r.finish(ticket)
    headers = {SLO_TTFT_HEADER: "150"}
    _, ticket = r.route(req("x" * 4000, model="tiny", objective="chat", headers=headers))
    assert ticket.basis is not None
    assert ticket.basis.target == LatencyTarget(pytest.approx(0.15), pytest.approx(0.02))
    r.finish(ticket)
    # An objective without targets gets the profile's default; a bad header is ignored.
    headers = {SLO_TPOT_HEADER: "fast please"}
    _, ticket = r.route(req("x" * 4000, model="tiny", objective="batch", headers=headers))
    assert ticket.basis is not None
    assert ticket.basis.target == LatencyTarget(ttft=pytest.approx(2.0))


async def test_tpot_attainment_is_counted_per_objective() -> None:
    r = await router()
    _, ticket = r.route(req("x" * 4000, model="tiny", objective="chat"))
    met, missed = _sample("met", "chat", "tpot"), _sample("missed", "chat", "tpot")
    r.learning.decoded(PickRecord(ticket, picked_at=10.0, decoding=1), 0.015)
    r.learning.decoded(PickRecord(ticket, picked_at=10.0, decoding=1), 0.025)
    assert (_sample("met", "chat", "tpot"), _sample("missed", "chat", "tpot")) == (
        met + 1,
        missed + 1,
    )


def test_objective_targets_are_validated_at_load() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(
            {
                "models": {"tiny": {"pools": ["main"]}},
                "pools": {"main": {"endpoints": [FAST]}},
                "request": {"objectives": {"chat": {"priority": 1, "ttft_ms": 0, "tpot_ms": "x"}}},
            }
        )
    assert "ttft_ms" in str(refused.value)
    assert "tpot_ms" in str(refused.value)


async def capacity_router(learned: bool, slow_weight: float | None = None) -> Router:
    slow: object = SLOW if slow_weight is None else {"address": SLOW, "weight": slow_weight}
    raw: dict[str, object] = {
        "models": {"tiny": {"pools": ["main"]}},
        "pools": {"main": {"endpoints": [FAST, slow]}},
        "routing": {"learned_capacity": learned},
    }
    config = parse_config(raw)
    store = MemoryStore()
    for address in (FAST, SLOW):
        await store.put_endpoint(EndpointState(address, "main", True, EndpointMetrics(), 1.0))
    fleet = FleetState(store)
    teach(fleet, time.time())
    router = Router(config, fleet)
    fleet.latency.configure(config.weights, [FAST, SLOW])
    return router


async def test_learned_speed_sends_cold_prompts_to_the_faster_replica_without_weights() -> None:
    """The default configuration: routing.learned_capacity off, no weights, the ttft-scorer's
    ``learned_speed`` on: the TTFT estimate divides prefill by the learned speeds, so prompts
    cached nowhere go to FAST, one at a time (each finished before the next: equal loads;
    eight, which a coin would all send to FAST once in 256)."""
    router = await capacity_router(learned=False)
    for i in range(8):
        decision, ticket = router.route(req(f"{i} " + "x" * 4000, model="tiny"))
        assert decision.endpoints[0].address == FAST
        router.finish(ticket)


async def test_learned_capacities_reach_the_default_profile_and_weights_override_them() -> None:
    """With routing.learned_capacity the default profile's load and TTFT scorers divide by the
    learned capacity (FAST ~10x SLOW here): cold requests go to FAST. A configured weight
    wins over what was learned."""
    router = await capacity_router(learned=True)
    picked = set()
    # A few: the TTFT scorer's prefill backlog on FAST grows with each pick (no time passes).
    for i in range(5):
        decision, ticket = router.route(req(f"{i} " + "x" * 4000, model="tiny"))
        picked.add(decision.endpoints[0].address)
        router.finish(ticket)
    assert picked == {FAST}
    router = await capacity_router(learned=True, slow_weight=100.0)
    decision, _ = router.route(req("y" * 4000, model="tiny"))
    assert decision.endpoints[0].address == SLOW
