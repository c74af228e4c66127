"""predicted-latency-scorer: learned speeds instead of hand-set capacity weights."""

from __future__ import annotations

import pytest

from epp.config import ConfigError, parse_config
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.scheduling.scorers.latency import (
    PREDICTED_LATENCY,
    PredictedLatencyParams,
    PredictedLatencyScorer,
)
from epp.state.fleet import FleetState
from epp.state.inflight import Load
from epp.state.latency import Basis, ttft_features
from tests.unit.scheduling.common import cycle, ep, req, scored

FAST, SLOW = "fast:1", "slow:1"


def learned(now: float = 1000.0) -> FleetState:
    """A fleet whose latency model has seen FAST prefill at 20k tokens/s, SLOW at 5k."""
    fleet = FleetState()
    for address, rate in ((FAST, 20_000.0), (SLOW, 5_000.0)):
        for i in range(40):
            uncached = 200.0 + 100 * i
            features = ttft_features(uncached, Load(), ep(address))
            basis = Basis(features, 0.0)
            fleet.latency.observe_ttft(address, basis, 0.01 + uncached / rate, now - 10 + i / 10)
    return fleet


def test_without_weights_the_learned_faster_endpoint_wins() -> None:
    fleet = learned()
    c = cycle(fleet)
    scores = scored(PredictedLatencyScorer(), req("x" * 8000), [ep(FAST), ep(SLOW)], c)
    assert scores[0] == 1.0
    assert scores[1] < 0.5
    predicted = c.get(PREDICTED_LATENCY)
    assert predicted is not None
    assert predicted[SLOW].ttft == pytest.approx(4 * predicted[FAST].ttft, rel=0.3)


def test_queued_prefill_on_the_fast_endpoint_sends_work_to_the_slow_one() -> None:
    fleet = learned()
    for _ in range(4):  # four long prompts still prefilling on FAST
        fleet.inflight.add(FAST, 8200, 8000)
    scores = scored(PredictedLatencyScorer(), req("x" * 2000), [ep(FAST), ep(SLOW)], cycle(fleet))
    assert scores[1] == 1.0 > scores[0]


def test_a_cached_prefix_counts_as_prefill_not_needed() -> None:
    fleet = learned()
    c = cycle(fleet)
    c.put(CACHED_TOKENS, {SLOW: 7000})
    scores = scored(PredictedLatencyScorer(), req("x" * 8 * 4000), [ep(FAST), ep(SLOW)], c)
    assert scores[1] == 1.0 > scores[0]


def test_tpot_weight_adds_the_predicted_decode() -> None:
    fleet = learned()
    for _ in range(30):
        fleet.latency.observe_tpot(SLOW, 1, 0.2, 999.0)  # SLOW decodes at 0.2 s a token
    request = req("x" * 400, max_tokens=200)
    alone = scored(PredictedLatencyScorer(), request, [ep(FAST), ep(SLOW)], cycle(fleet))
    params = PredictedLatencyParams(tpot_weight=1.0)
    both = scored(PredictedLatencyScorer(params), request, [ep(FAST), ep(SLOW)], cycle(fleet))
    assert both[1] < alone[1]


def test_parameters_are_typed_in_the_configuration() -> None:
    def profile(parameters: dict[str, object]) -> dict[str, object]:
        return {
            "models": {"m": {"pools": ["p"]}},
            "pools": {"p": {"endpoints": ["127.0.0.1:1"]}},
            "scheduling": {
                "profile": "learned",
                "plugins": [
                    {"name": "lat", "type": "predicted-latency-scorer", "parameters": parameters}
                ],
                "profiles": {
                    "learned": [{"plugin": "lat", "weight": 2}, {"plugin": "max-score-picker"}]
                },
            },
        }

    parse_config(profile({"tpot_weight": 0.5}))
    with pytest.raises(ConfigError, match=r"parameters\.slack_seconds: must be a number > 0"):
        parse_config(profile({"slack_seconds": 0}))
