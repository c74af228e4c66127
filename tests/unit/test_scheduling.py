"""Scheduling plugins and the profile pipeline."""

from __future__ import annotations

from collections import Counter

import pytest

from epp.request import InferenceRequest
from epp.scheduling import Cycle, Profile
from epp.scheduling.filters.ready import ReadyEndpointFilter
from epp.scheduling.pickers.max_score import MaxScoreParams, MaxScorePicker
from epp.scheduling.scorers.kv_utilization import KvCacheUtilizationScorer
from epp.scheduling.scorers.queue import QueueScorer
from epp.state import EndpointMetrics, EndpointState, Snapshot

REQ = InferenceRequest("r", "/v1/completions", "completions", "m", "hello")
CYCLE = Cycle(Snapshot())


def ep(addr: str, waiting: int = 0, kv: float = 0.0, ready: bool = True) -> EndpointState:
    return EndpointState(addr, "p", ready, EndpointMetrics(waiting=waiting, kv_usage=kv), 1.0)


def test_ready_filter() -> None:
    eps = [ep("a"), ep("b", ready=False)]
    assert [e.address for e in ReadyEndpointFilter().filter(REQ, eps, CYCLE)] == ["a"]


def test_queue_scorer_min_max_normalised() -> None:
    scores = QueueScorer().score(REQ, [ep("a", 0), ep("b", 5), ep("c", 10)], CYCLE)
    assert scores == [1.0, 0.5, 0.0]
    assert QueueScorer().score(REQ, [ep("a", 3), ep("b", 3)], CYCLE) == [1.0, 1.0]


def test_kv_scorer() -> None:
    assert KvCacheUtilizationScorer().score(REQ, [ep("a", kv=0.25), ep("b", kv=1.2)], CYCLE) == [
        0.75,
        0.0,
    ]


def test_max_score_picker_orders_fallbacks_and_breaks_ties_randomly() -> None:
    picker = MaxScorePicker(MaxScoreParams(seed=7))
    eps = [ep("a"), ep("b"), ep("c")]
    assert [e.address for e in picker.pick(eps, [0.1, 0.9, 0.5], 2)] == ["b", "c"]
    firsts = Counter(picker.pick(eps, [1.0, 1.0, 0.0], 1)[0].address for _ in range(400))
    assert set(firsts) == {"a", "b"}
    assert min(firsts.values()) > 120


def profile() -> Profile:
    return Profile(
        "t",
        [ReadyEndpointFilter()],
        [(QueueScorer(), 2.0), (KvCacheUtilizationScorer(), 2.0)],
        MaxScorePicker(MaxScoreParams(seed=1)),
    )


def test_profile_prefers_short_queue_and_explains() -> None:
    eps = [ep("busy", waiting=20, kv=0.1), ep("idle", waiting=0, kv=0.3), ep("down", ready=False)]
    decision = profile().run(REQ, eps, CYCLE, count=2, explain=True)
    assert [e.address for e in decision.endpoints] == ["idle", "busy"]
    assert decision.scores is not None
    assert decision.scores["idle"]["total"] == pytest.approx(2.0 + 1.4)
    assert "down" not in decision.scores


def test_profile_with_no_ready_endpoint_picks_nothing() -> None:
    assert profile().run(REQ, [ep("a", ready=False)], CYCLE, count=1).endpoints == []
