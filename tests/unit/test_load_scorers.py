"""In-flight load and TTFT-estimate scorers."""

from __future__ import annotations

import pytest

from epp.request import InferenceRequest
from epp.scheduling import Cycle
from epp.scheduling.scorers.load import InflightLoadScorer
from epp.scheduling.scorers.ttft import TtftScorer
from epp.state import EndpointMetrics, EndpointState, Snapshot
from epp.state.fleet import FleetState


def ep(addr: str, waiting: int = 0, running: int = 0) -> EndpointState:
    return EndpointState(addr, "p", True, EndpointMetrics(waiting=waiting, running=running), 1.0)


def req(prompt_chars: int = 4000, max_tokens: int = 100) -> InferenceRequest:
    return InferenceRequest(
        "r", "/v1/completions", "completions", "m", "x" * prompt_chars, max_tokens=max_tokens
    )


def test_inflight_spreads_a_burst_between_scrapes() -> None:
    """Scraped metrics say all idle; our own picks must still push the next request elsewhere."""
    fleet = FleetState()
    eps = [ep("a"), ep("b"), ep("c")]
    scorer = InflightLoadScorer()
    chosen = []
    for _ in range(6):
        cycle = Cycle(Snapshot(), fleet)
        scores = scorer.score(req(), eps, cycle)
        best = eps[max(range(3), key=lambda i: (scores[i], -i))]
        fleet.inflight.add(best.address, req().expected_tokens())
        chosen.append(best.address)
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]


def test_inflight_release_restores_score() -> None:
    fleet = FleetState()
    ticket = fleet.inflight.add("a", 1000)
    scores = InflightLoadScorer().score(req(), [ep("a"), ep("b")], Cycle(Snapshot(), fleet))
    assert scores == [0.0, 1.0]
    fleet.inflight.release(ticket)
    assert InflightLoadScorer().score(req(), [ep("a"), ep("b")], Cycle(Snapshot(), fleet)) == [
        1.0,
        1.0,
    ]


def test_scraped_queue_counts_when_epp_did_not_route_it() -> None:
    scores = InflightLoadScorer().score(req(), [ep("a", waiting=4), ep("b")], Cycle(Snapshot()))
    assert scores == [0.0, 1.0]


def test_capacity_weight_divides_load() -> None:
    fleet = FleetState()
    fleet.inflight.add("fast", 1000)
    fleet.inflight.add("slow", 600)
    cycle = Cycle(Snapshot(), fleet, weights={"fast": 2.0})
    assert InflightLoadScorer().score(req(), [ep("fast"), ep("slow")], cycle) == [1.0, 0.0]


def test_ttft_trades_cache_hits_against_queued_work() -> None:
    # 1000-token prompt; "warm" has 900 tokens cached but 300 tokens queued; "cold" is idle.
    fleet = FleetState()
    fleet.inflight.add("warm", 300)
    cycle = Cycle(Snapshot(), fleet)
    cycle.data["approx_cached_tokens"] = {"warm": 900}
    warm, cold = TtftScorer().score(req(4000), [ep("warm"), ep("cold")], cycle)
    assert warm == 1.0  # 300 + 101 tokens of work beats 1001
    assert cold == pytest.approx((401 + 64) / (1001 + 64))
    # Heavy queue on the warm replica flips the choice.
    fleet.inflight.add("warm", 5000)
    warm, cold = TtftScorer().score(req(4000), [ep("warm"), ep("cold")], cycle)
    assert cold == 1.0
    assert warm < 0.5


def test_precise_cached_tokens_win_over_approximate() -> None:
    cycle = Cycle(Snapshot(), FleetState())
    cycle.data["approx_cached_tokens"] = {"a": 1000}
    cycle.data["cached_tokens"] = {"b": 1000}
    a, b = TtftScorer().score(req(4000), [ep("a"), ep("b")], cycle)
    assert b == 1.0
    assert a < 0.2


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="tokens_per_request"):
        TtftScorer(tokens_per_request=0)
    with pytest.raises(ValueError, match="tokens_per_request"):
        InflightLoadScorer(tokens_per_request=-1)
