"""The passive-health circuit (epp.state.health) on a fake clock: ejection rules, backoff,
half-open trials, the pool's ejection cap and the sharing of verdicts."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY

from epp.config import ConfigError, parse_config
from epp.state.health import Circuit, EndpointHealth, HealthConfig, HealthTracker, Verdict

POOL = ("a", "b", "c", "d")
CONFIG = HealthConfig(
    consecutive_failures=3,
    error_rate=0.5,
    window_seconds=10.0,
    min_requests=6,
    latency_factor=3.0,
    latency_floor_seconds=0.01,
    latency_samples=4,
    base_ejection_seconds=5.0,
    max_ejection_seconds=20.0,
    max_ejection_percent=50.0,
    trial_successes=1,
)


def tracker() -> HealthTracker:
    health = HealthTracker(CONFIG)
    health.configure(CONFIG, POOL)
    return health


def fail(health: HealthTracker, endpoint: str, now: float, times: int = 1) -> None:
    for _ in range(times):
        health.observe(endpoint, "p", POOL, True, None, now, "5xx")


def ok(health: HealthTracker, endpoint: str, now: float, latency: float = 0.01) -> None:
    health.observe(endpoint, "p", POOL, False, latency, now)


def circuit(health: HealthTracker, endpoint: str, now: float) -> Circuit:
    state = health.state(endpoint)
    return Circuit.CLOSED if state is None else state.circuit(now)


def gauge(endpoint: str) -> float | None:
    return REGISTRY.get_sample_value("epp_endpoint_ejected", {"pool": "p", "endpoint": endpoint})


def test_consecutive_failures_open_then_half_open_trial_success_closes() -> None:
    health = tracker()
    fail(health, "a", 100.0, 2)
    assert circuit(health, "a", 100.0) is Circuit.CLOSED
    fail(health, "a", 100.1)
    assert circuit(health, "a", 100.1) is Circuit.OPEN
    assert not health.admits("a", 104.9)
    assert gauge("a") == 1
    # After the base ejection time: half-open, one trial at a time.
    assert circuit(health, "a", 105.2) is Circuit.HALF_OPEN
    assert health.admits("a", 105.2)
    health.picked("a", 105.2)
    assert not health.admits("a", 105.3)
    ok(health, "a", 105.4)
    assert circuit(health, "a", 105.4) is Circuit.CLOSED
    assert health.admits("a", 105.4)
    assert gauge("a") == 0


def test_several_trials_in_a_row_close_and_a_slow_trial_reopens() -> None:
    health = tracker()
    health.configure(replace(CONFIG, trial_successes=2), POOL)
    for i in range(4):
        for endpoint in ("b", "c"):
            ok(health, endpoint, float(i), 0.02)
    fail(health, "a", 4.0, 3)
    health.picked("a", 9.0)
    ok(health, "a", 9.0)
    assert circuit(health, "a", 9.0) is Circuit.HALF_OPEN
    assert not health.admits("a", 9.4)  # one trial per trial_interval_seconds
    assert health.admits("a", 9.5)
    health.picked("a", 9.5)
    ok(health, "a", 9.6)
    assert circuit(health, "a", 9.6) is Circuit.CLOSED
    fail(health, "a", 9.7)  # probation: one failure is enough
    state = health.state("a")
    assert state is not None
    assert state.reason == "probation"
    assert state.until == 9.7 + 10.0
    for i in range(4):  # the others' latency, recent enough for the window
        for endpoint in ("b", "c"):
            ok(health, endpoint, 15.0 + i, 0.02)
    ok(health, "a", 19.8, 0.5)  # answered, but 25 x the others: the trial failed
    state = health.state("a")
    assert state is not None
    assert state.reason == "trial-latency"
    assert circuit(health, "a", 19.9) is Circuit.OPEN


def test_failed_trial_reopens_for_twice_as_long_capped() -> None:
    health = tracker()
    fail(health, "a", 0.0, 3)
    state = health.state("a")
    assert state is not None
    assert state.until == 5.0
    health.picked("a", 5.0)
    fail(health, "a", 5.1)  # the trial failed: 10 s
    assert state.until == 5.1 + 10.0
    assert state.reason == "trial-5xx"
    fail(health, "a", 15.2)  # 20 s
    assert state.until == 15.2 + 20.0
    fail(health, "a", 35.3)  # would be 40 s: capped at max_ejection_seconds
    assert state.until == 35.3 + 20.0
    assert state.ejections == 4


def test_backoff_restarts_after_a_long_healthy_spell() -> None:
    health = tracker()
    fail(health, "a", 0.0, 3)
    ok(health, "a", 5.0)  # trial closes it, one ejection on record
    fail(health, "a", 6.0, 3)
    state = health.state("a")
    assert state is not None
    assert state.until == 6.0 + 10.0
    ok(health, "a", 16.0)
    fail(health, "a", 16.0 + 21.0, 3)  # closed longer than max_ejection_seconds: base again
    assert state.until == 37.0 + 5.0


def test_error_rate_over_the_window_ejects_without_a_run_of_failures() -> None:
    health = tracker()
    for i in range(5):
        ok(health, "b", float(i))
        fail(health, "b", i + 0.5)
        assert circuit(health, "b", i + 0.5) is (Circuit.CLOSED if i < 2 else Circuit.OPEN)
    state = health.state("b")
    assert state is not None
    assert state.reason == "error-rate"


def test_old_failures_age_out_of_the_window() -> None:
    health = tracker()
    for i in range(20):
        t = i * 4.0  # one failure, one success every 4 s: at most 3 answers in a 10 s window
        fail(health, "b", t)
        ok(health, "b", t + 1)
    assert circuit(health, "b", 80.0) is Circuit.CLOSED


def test_latency_outlier_against_the_other_endpoints_median() -> None:
    health = tracker()
    for i in range(4):
        for endpoint in ("a", "b", "c"):
            ok(health, endpoint, float(i), 0.02)
    for i in range(3):
        ok(health, "d", float(i), 0.2)
    assert circuit(health, "d", 3.0) is Circuit.CLOSED  # 3 samples: below latency_samples
    ok(health, "d", 3.0, 0.2)
    state = health.state("d")
    assert state is not None
    assert state.reason == "latency"
    # Within the factor: not an outlier.
    for i in range(4):
        ok(health, "c", 10.0 + i, 0.05)
    assert circuit(health, "c", 14.0) is Circuit.CLOSED


def test_latency_below_the_floor_never_ejects() -> None:
    health = tracker()
    for i in range(4):
        for endpoint in ("a", "b"):
            ok(health, endpoint, float(i), 0.0001)
        ok(health, "c", float(i), 0.005)  # 50 x the others, but under 10 ms
    assert circuit(health, "c", 4.0) is Circuit.CLOSED


def test_the_ejection_cap_keeps_half_the_pool_and_never_the_last() -> None:
    health = tracker()
    for endpoint in POOL:
        fail(health, endpoint, 0.0, 3)
    assert sorted(health.ejected("p")) == ["a", "b"]  # 50% of 4
    single = HealthTracker(HealthConfig(consecutive_failures=1, max_ejection_percent=100))
    single.observe("x", "solo", ("x",), True, None, 0.0, "5xx")
    assert single.ejected("solo") == []  # the last endpoint of a pool stays


def test_answers_to_picks_made_before_the_ejection_are_not_counted() -> None:
    health = tracker()
    fail(health, "a", 0.0, 3)
    fail(health, "a", 1.0, 10)  # late answers while open
    state = health.state("a")
    assert state is not None
    assert state.ejections == 1
    assert state.until == 5.0


def test_verdicts_are_shared_and_applied_by_another_process() -> None:
    one, two = tracker(), tracker()
    fail(one, "c", 0.0, 3)
    shipped = one.take_recent()
    assert shipped == [Verdict("c", "p", 5.0, 1, "consecutive")]
    assert one.take_recent() == []
    two.apply(shipped)
    assert not two.admits("c", 1.0)
    # The other process's trial succeeds: its readmission closes the circuit here too.
    ok(two, "c", 6.0)
    one.apply(two.take_recent())
    assert one.admits("c", 6.1)
    assert circuit(one, "c", 6.1) is Circuit.CLOSED


def test_remote_verdicts_are_under_the_same_ejection_cap() -> None:
    """Half of a pool of four may be ejected: two other processes' ejections apply here, a
    third does not (it would eject a third replica), whoever decided it."""
    here = HealthTracker(CONFIG)
    here.configure(CONFIG, dict.fromkeys(POOL, "p"))
    verdicts = []
    for endpoint in ("a", "b", "c"):
        other = tracker()
        fail(other, endpoint, 0.0, 3)
        verdicts.extend(other.take_recent())
    here.apply(verdicts)
    assert sorted(here.ejected("p")) == ["a", "b"]
    assert here.admits("c", 1.0)
    # A local ejection finds no room either.
    fail(here, "d", 1.0, 3)
    assert here.admits("d", 1.1)
    # An endpoint already ejected here may have its ejection extended by another process.
    other = tracker()
    fail(other, "a", 3.0, 3)
    here.apply(other.take_recent())
    state = here.state("a")
    assert state is not None
    assert state.until == 8.0


def test_an_answer_cut_short_is_no_verdict_even_as_a_trial() -> None:
    health = tracker()
    fail(health, "a", 0.0, 3)
    assert circuit(health, "a", 5.0) is Circuit.HALF_OPEN
    health.picked("a", 5.0)
    assert not health.admits("a", 5.6)  # the trial is out (until trial_timeout_seconds)
    health.inconclusive("a", 5.6)
    assert health.admits("a", 5.6)  # no pass, no failure: the next trial may go
    assert circuit(health, "a", 5.6) is Circuit.HALF_OPEN


def test_leaving_endpoints_and_disabling_forget_state_and_series() -> None:
    health = tracker()
    fail(health, "d", 0.0, 3)
    assert gauge("d") == 1
    health.configure(CONFIG, ("a", "b", "c"))
    assert health.state("d") is None
    assert gauge("d") is None
    fail(health, "a", 0.0, 3)
    health.configure(HealthConfig(enabled=False), POOL)
    assert health.admits("a", 1.0)
    fail(health, "b", 1.0, 10)
    assert health.ejected("p") == []


BASE: dict[str, object] = {
    "models": {"m": {"pools": ["p"]}},
    "pools": {"p": {"endpoints": ["127.0.0.1:8001"]}},
}


def test_health_section_is_parsed_and_every_problem_reported() -> None:
    config = parse_config(
        {
            **BASE,
            "health": {"error_rate": 0.5, "base_ejection_seconds": 2, "latency_prompt_tokens": 0},
        }
    )
    assert config.health == HealthConfig(
        error_rate=0.5, base_ejection_seconds=2.0, latency_prompt_tokens=0
    )
    with pytest.raises(ConfigError) as info:
        parse_config(
            {
                **BASE,
                "health": {
                    "error_rate": 1.5,
                    "max_ejection_percent": 120,
                    "base_ejection_seconds": 30,
                    "max_ejection_seconds": 10,
                    "consecutive_failures": 0,
                    "latency_factor": 0.5,
                    "latency_prompt_tokens": -1,
                    "typo": 1,
                },
            }
        )
    joined = "\n".join(info.value.errors)
    for expected in (
        "health.typo",
        "health.error_rate: must be a fraction in (0, 1], got 1.5",
        "health.max_ejection_percent: must be a percentage in [0, 100], got 120",
        "health.max_ejection_seconds: must be >= base_ejection_seconds (30), got 10",
        "health.consecutive_failures: must be an integer >= 1, got 0",
        "health.latency_factor: must be a number >= 1, got 0.5",
        "health.latency_prompt_tokens: must be an integer >= 0, got -1",
    ):
        assert expected in joined
    assert len(info.value.errors) == 7


def test_window_median_is_the_statistics_median_of_the_latest_samples() -> None:
    rng = random.Random(5)
    health = EndpointHealth("p")
    for step in range(200):
        health.latencies.append((float(step), rng.choice((0.1, 0.25, rng.random()))))
        for count in (1, 2, 3, 10, 11):
            latest = [s for _, s in list(health.latencies)[-count:]]
            wanted = statistics.median(latest) if len(health.latencies) >= count else None
            assert health.median_latency(count) == wanted
