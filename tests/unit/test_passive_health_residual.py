"""Passive health's residual rule: a streamed TTFT judged against the latency model's
prediction for that request on that endpoint (epp.hooks.passive_health, epp.state.health)."""

from __future__ import annotations

from epp.hooks.passive_health import judge
from epp.lifecycle import Outcome
from epp.state.health import Circuit, HealthConfig, HealthTracker
from epp.state.latency import Basis, LatencyModel
from epp.state.latency_fit import ROBUST_AFTER

POOLS = {"main": ("a", "b", "c", "d")}
MEMBERS = POOLS["main"]


def tracker(**settings: object) -> HealthTracker:
    config = HealthConfig(latency_samples=5, max_ejection_percent=50, **settings)  # type: ignore[arg-type]
    health = HealthTracker(config)
    health.configure(config, MEMBERS)
    return health


def streamed(ttft: float) -> Outcome:
    return Outcome("a", 200, seconds=2.0, complete=True, streamed=True, ttft=ttft)


def serve(health: HealthTracker, endpoint: str, ttft: float, expected: float, now: float) -> None:
    judge(health, POOLS, endpoint, streamed(ttft), now, ahead=None, expected=expected)


def test_cache_driven_spread_the_model_predicted_ejects_nobody() -> None:
    """The tails workload's healthy fleet: "a" prefills cold 2,300-token prompts (0.45 s),
    "b" serves hits of the same groups (0.08 s), "c" holds the popular prefixes and its hits
    wait behind a queue (0.9 s), "d" is idle. Each is within its own prediction; against the
    pool ("pool" rule, with nothing known of the work ahead) "a" and "c" were outliers."""
    cases = {"a": (0.45, 0.40), "b": (0.08, 0.07), "c": (0.90, 1.1), "d": (0.03, 0.02)}
    residual, pool = tracker(), tracker(latency_rule="pool")
    for i in range(20):
        for endpoint, (ttft, expected) in cases.items():
            serve(residual, endpoint, ttft, expected, 1.0 + i * 0.1)
            serve(pool, endpoint, ttft, expected, 1.0 + i * 0.1)
    assert residual.ejected("main") == []
    assert pool.ejected("main") != []


def test_a_replica_slower_than_its_model_is_ejected_after_a_majority_of_samples() -> None:
    """200 ms added to every first token (the e2e fault) on predictions of 50 ms: residual
    0.25 / 0.05 = 5 > 3. Ejected at the third slow answer, when the median of the last five
    turns, not before."""
    health = tracker()
    for i in range(8):
        serve(health, "a", 0.055, 0.05, 1.0 + i * 0.1)
    state = health.state("a")
    assert state is not None
    assert state.until == 0.0
    serve(health, "a", 0.25, 0.05, 2.0)
    serve(health, "a", 0.25, 0.05, 2.1)
    assert state.until == 0.0
    serve(health, "a", 0.25, 0.05, 2.2)
    assert state.circuit(2.2) is Circuit.OPEN
    assert state.reason == "latency"


def test_a_few_slow_answers_are_not_persistent() -> None:
    """One in four answers three times slower than predicted never moves the median."""
    health = tracker()
    for i in range(40):
        serve(health, "a", 0.9 if i % 4 == 0 else 0.3, 0.3, 1.0 + i * 0.1)
    assert health.ejected("main") == []


def test_the_floor_keeps_milliseconds_over_a_tiny_prediction_from_counting() -> None:
    """30 ms measured on 5 ms predicted is 6x, but below latency_floor_seconds (50 ms) the
    prediction counts as the floor: 0.6."""
    health = tracker()
    for i in range(8):
        serve(health, "a", 0.03, 0.005, 1.0 + i * 0.1)
    state = health.state("a")
    assert state is not None
    assert [round(r, 3) for _, r in state.residuals][:1] == [0.6]
    assert state.until == 0.0


def test_without_a_prediction_a_ttft_is_no_sample_and_whole_responses_meet_the_pool() -> None:
    health = tracker()
    judge(health, POOLS, "a", streamed(5.0), 1.0, ahead=4096, expected=None)
    whole = Outcome("a", 200, seconds=0.7, complete=True, streamed=False)
    judge(health, POOLS, "a", whole, 2.0, expected=0.1)
    state = health.state("a")
    assert state is not None
    assert list(state.residuals) == []
    assert [s for _, s in state.latencies] == [0.7]


def test_latency_rule_off_takes_no_latency_sample() -> None:
    health = tracker(latency_rule="off")
    serve(health, "a", 5.0, 0.1, 1.0)
    judge(health, POOLS, "a", Outcome("a", 200, 3.0, True, False), 2.0)
    state = health.state("a")
    assert state is not None
    assert list(state.residuals) == []
    assert list(state.latencies) == []
    assert [failed for _, failed in state.outcomes] == [False, False]


def test_a_half_open_trial_slower_than_predicted_reopens_and_on_time_ones_close() -> None:
    health = tracker(trial_successes=2, base_ejection_seconds=1.0)
    for i in range(5):
        serve(health, "a", 1.0, 0.1, 1.0 + i * 0.1)
    state = health.state("a")
    assert state is not None
    assert state.circuit(1.5) is Circuit.OPEN
    assert health.admits("a", 2.5)
    health.picked("a", 2.5)
    serve(health, "a", 1.0, 0.1, 2.6)
    assert state.reason == "trial-latency"
    assert state.circuit(2.6) is Circuit.OPEN
    later = state.until + 0.1
    for step in range(2):
        now = later + step
        assert health.admits("a", now)
        health.picked("a", now)
        serve(health, "a", 0.1, 0.1, now + 0.05)
    assert state.circuit(later + 2) is Circuit.CLOSED


def test_the_model_is_trusted_once_it_has_evidence_for_the_endpoint() -> None:
    """Before ROBUST_AFTER observations' weight its predictions are mostly the prior, which
    knows nothing of the replica's speed: no residuals are judged by them."""
    model = LatencyModel()
    features = (1.0, 2.0, 0.0, 0.0)
    basis = Basis(features, model.predict_ttft("a", features, 0.0))
    assert not model.trusted("a", 0.0)
    assert not model.trusted("never-seen", 0.0)
    model.observe_ttft("a", basis, 0.4, 0.0)
    assert not model.trusted("a", 0.0)
    for i in range(1, int(ROBUST_AFTER) + 1):
        model.observe_ttft("a", basis, 0.4, i * 0.01)
    assert model.trusted("a", 0.1)
    # Evidence decays: two minutes later (four half-lives) it is not enough any more.
    assert not model.trusted("a", 120.0)
