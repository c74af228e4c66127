"""What a response counts as for passive health (epp.extproc.passive_health)."""

from __future__ import annotations

from epp.extproc.passive_health import judge, judge_retry
from epp.extproc.response_stream import Outcome
from epp.state.health import HealthConfig, HealthTracker

POOLS = {"main": ("a", "b")}


def tracker() -> HealthTracker:
    health = HealthTracker()
    health.configure(HealthConfig(consecutive_failures=100, latency_samples=1), ("a", "b"))
    return health


def outcome(status: int = 200, complete: bool = True, streamed: bool = False) -> Outcome:
    return Outcome("a", status, seconds=0.5, complete=complete, streamed=streamed, ttft=0.1)


def test_5xx_incomplete_and_retries_are_failures() -> None:
    health = tracker()
    judge(health, POOLS, "a", outcome(503), 1.0)
    judge(health, POOLS, "a", outcome(complete=False), 1.0)
    judge_retry(health, POOLS, "a", 1.0)
    state = health.state("a")
    assert state is not None
    assert state.pool == "main"
    assert state.consecutive == 3
    assert [failed for _, failed in state.outcomes] == [True, True, True]


def test_client_errors_are_successes_without_a_latency_sample() -> None:
    health = tracker()
    judge(health, POOLS, "a", outcome(404), 1.0)
    state = health.state("a")
    assert state is not None
    assert [failed for _, failed in state.outcomes] == [False]
    assert list(state.latencies) == []


def test_latency_is_ttft_when_streamed_and_the_whole_response_otherwise() -> None:
    health = tracker()
    judge(health, POOLS, "a", outcome(streamed=True), 1.0)
    judge(health, POOLS, "a", outcome(), 2.0)
    state = health.state("a")
    assert state is not None
    assert [s for _, s in state.latencies] == [0.1, 0.5]
