"""head-of-line-filter: prefix affinity yields when the learned predicted wait behind a
replica's queue exceeds the prefill another replica would spend."""

from __future__ import annotations

from collections import Counter

import pytest

from epp.config import ConfigError, parse_config
from epp.scheduling.filters.head_of_line import HeadOfLineFilter, HeadOfLineParams
from epp.scheduling.params import NoParams
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.scheduling.scorers.prefix import PrefixParams
from epp.state.fleet import FleetState
from epp.state.inflight import Load
from epp.state.latency import Basis, ttft_features
from tests.unit.scheduling.common import cycle, ep, profile_of, req, text

NOW = 1000.0
RATE = 10_000.0  # every replica prefills 10k tokens/s, queued or its own: TTFT = 0.02 + work
HOT, COLD = "hot:1", "cold:1"


def learned(addresses: tuple[str, ...], now: float = NOW) -> FleetState:
    """A fleet whose latency model has learned each endpoint: TTFT = 0.02 s + (uncached +
    queued ahead) / RATE, from requests with and without a queue ahead."""
    fleet = FleetState()
    for address in addresses:
        for i in range(60):
            uncached, queued = 200.0 + 100 * (i % 20), 1000.0 * (i % 4)
            load = Load(requests=i % 4, tokens=int(queued), prefill=int(queued), waiting=i % 4)
            features = ttft_features(uncached, load, ep(address))
            seconds = 0.02 + (uncached + queued) / RATE
            fleet.latency.observe_ttft(address, Basis(features, 0.0), seconds, now - 6 + i / 10)
    return fleet


def kept(fleet: FleetState, cached: dict[str, int], params: HeadOfLineParams) -> list[str]:
    c = cycle(fleet, now=NOW)
    c.put(CACHED_TOKENS, cached)
    request = req("x" * 4 * 2300)  # 2,300 prompt tokens
    chosen = HeadOfLineFilter(params).filter(request, [ep(HOT), ep(COLD)], c)
    return [e.address for e in chosen]


def test_affinity_stays_while_the_wait_is_below_the_prefill_it_saves() -> None:
    """HOT caches 2,000 of the 2,300 tokens and has 1,000 queued: 0.15 s against COLD's 0.25 s
    cold prefill. Both stay, the scorers choose."""
    fleet = learned((HOT, COLD))
    fleet.inflight.add(HOT, 1000, 1000)
    assert kept(fleet, {HOT: 2000}, HeadOfLineParams()) == [HOT, COLD]


def test_affinity_yields_when_the_predicted_wait_exceeds_the_saved_prefill() -> None:
    """Six cold 1,000-token prompts queued on HOT: 0.65 s there against 0.25 s cold on COLD,
    beyond 0.25 x 1.5 + 0.1: HOT is dropped; with a tolerance of 2 it stays."""
    fleet = learned((HOT, COLD))
    for _ in range(6):
        fleet.inflight.add(HOT, 1000, 1000)
    assert kept(fleet, {HOT: 2000}, HeadOfLineParams()) == [COLD]
    assert kept(fleet, {HOT: 2000}, HeadOfLineParams(tolerance=2.0)) == [HOT, COLD]


def test_a_hot_prefix_spreads_to_a_second_replica_once_the_first_saturates() -> None:
    """Sticky until saturated: requests sharing a 2,000-token system prompt plus 300 tokens
    of their own, none finishing (each leaves its uncached prompt queued where it went). They
    stay on the first replica until its queue (2,300 + 300 per request) outgrows a cold
    prefill (0.27 s, bound 0.5 s: 8 requests), then the overflow goes to one second replica,
    which keeps the prefix from then on, not to every replica in turn."""
    replicas = ("r0:1", "r1:1", "r2:1", "r3:1")
    fleet = learned(replicas)
    profile = profile_of(
        ("prefix-cache-scorer", PrefixParams(), 1.0),
        ("head-of-line-filter", HeadOfLineParams(), None),
        ("ready-endpoint-filter", NoParams(), None),
    )
    system = text("system", 2000 * 4)
    picks = []
    for i in range(14):
        request = req(system + text(f"q{i}", 300 * 4))
        c = cycle(fleet, now=NOW)
        (chosen,) = profile.run(request, [ep(r) for r in replicas], c, 1).endpoints
        cached = (c.get(CACHED_TOKENS) or {}).get(chosen.address, 0)
        uncached = request.prompt_tokens() - cached
        fleet.inflight.add(chosen.address, uncached, uncached)
        picks.append(chosen.address)
    first = picks[0]
    run = picks.index(next(p for p in picks if p != first))
    assert run == 8, picks  # the first replica keeps the prefix while it can
    assert len(set(picks[run:])) == 1, picks  # then a second one
    assert Counter(picks) == Counter({first: 8, picks[run]: 6})


def test_without_a_second_candidate_nothing_is_predicted_or_dropped() -> None:
    fleet = FleetState()
    only = [ep(HOT)]
    assert HeadOfLineFilter().filter(req("x" * 400), only, cycle(fleet)) is only


def test_parameters_are_validated() -> None:
    data = {
        "models": {"m": {"pools": ["p"]}},
        "pools": {"p": {"endpoints": ["127.0.0.1:1"]}},
        "scheduling": {
            "profile": "t",
            "profiles": {
                "t": [
                    {"plugin": "head-of-line-filter", "parameters": {"tolerance": -0.5}},
                    {"plugin": "max-score-picker"},
                ]
            },
        },
    }
    with pytest.raises(ConfigError, match="tolerance: must be a number >= 0"):
        parse_config(data, "<test>")
