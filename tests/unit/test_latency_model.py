"""The learned latency model: rates from noisy samples, forgetting, robustness, sharing."""

from __future__ import annotations

import random

import pytest

from epp.state.inflight import Load
from epp.state.latency import SPEED_BAND, Basis, LatencyModel, ttft_features
from epp.state.latency_fit import HALF_LIFE_S
from epp.state.snapshot import EndpointMetrics, EndpointState

FAST, SLOW = "10.0.0.1:8000", "10.0.0.2:8000"


def truth(rate: float, uncached: float, queued: float, decoding: int) -> float:
    """An endpoint's TTFT: 15 ms, prefill at ``rate`` tokens/s, 3 ms per decoding request."""
    return 0.015 + (uncached + queued) / rate + 0.003 * decoding


def feed(
    model: LatencyModel,
    address: str,
    rate: float,
    n: int,
    start: float,
    rng: random.Random,
    noise: float = 0.05,
) -> float:
    """``n`` requests of varied size and queue on ``address``, one every 0.1 s; returns the
    time after the last."""
    now = start
    for _ in range(n):
        uncached = rng.uniform(100, 3000)
        load = Load(requests=rng.randrange(0, 20), prefill=int(rng.uniform(0, 6000)), waiting=3)
        state = EndpointState(address, "p")
        features = ttft_features(uncached, load, state)
        seconds = truth(rate, uncached, load.prefill, load.decoding)
        seconds *= 1 + rng.gauss(0, noise)
        predicted = model.predict_ttft(address, features, now)
        model.observe_ttft(address, Basis(features, predicted), seconds, now)
        now += 0.1
    return now


def predict(model: LatencyModel, address: str, uncached: float, queued: int, now: float) -> float:
    load = Load(requests=5, prefill=queued, waiting=1)
    features = ttft_features(uncached, load, EndpointState(address, "p"))
    return model.predict_ttft(address, features, now)


def test_learns_each_endpoints_prefill_rate_and_queueing_from_noisy_samples() -> None:
    model = LatencyModel()
    rng = random.Random(1)
    now = feed(model, FAST, 20_000, 200, 0.0, rng)
    now = feed(model, SLOW, 5_000, 200, now, rng)
    for address, rate in ((FAST, 20_000), (SLOW, 5_000)):
        for uncached, queued in ((500, 0), (2000, 4000)):
            want = truth(rate, uncached, queued, 4)
            assert predict(model, address, uncached, queued, now) == pytest.approx(want, rel=0.15)
    described = model.describe(FAST, now)
    assert described is not None
    assert described["prefill_tokens_per_second"] == pytest.approx(20_000, rel=0.2)
    # Relative capacity: the fast endpoint does the reference request ~4x sooner.
    capacities = model.capacities(now)
    assert capacities[FAST] / capacities[SLOW] == pytest.approx(4, rel=0.25)


def test_old_evidence_is_forgotten() -> None:
    model = LatencyModel()
    rng = random.Random(2)
    now = feed(model, FAST, 20_000, 200, 0.0, rng)
    # The replica slows to a quarter of its speed (thermal throttling, a noisy neighbour).
    now = feed(model, FAST, 5_000, 300, now + 4 * HALF_LIFE_S, rng)
    assert predict(model, FAST, 2000, 0, now) == pytest.approx(truth(5_000, 2000, 0, 4), rel=0.15)


def test_outliers_do_not_drag_the_fit() -> None:
    model = LatencyModel()
    rng = random.Random(3)
    now = feed(model, FAST, 10_000, 100, 0.0, rng)
    features = ttft_features(1000, Load(), EndpointState(FAST, "p"))
    for _ in range(10):  # ten stalls of 30 s (a paused replica)
        model.observe_ttft(FAST, Basis(features, 0.1), 30.0, now)
        now += 0.1
    now = feed(model, FAST, 10_000, 20, now, rng)
    assert predict(model, FAST, 1000, 0, now) == pytest.approx(truth(10_000, 1000, 0, 4), rel=0.3)


def test_without_evidence_the_configured_weight_sets_the_prior() -> None:
    model = LatencyModel()
    model.configure({SLOW: 0.5}, [FAST, SLOW])
    assert predict(model, SLOW, 2000, 0, 0.0) > 1.8 * predict(model, FAST, 2000, 0, 0.0) - 0.05
    assert model.capacities(0.0) == {}  # nothing learned: scorers keep configured weights


def test_processes_share_evidence_and_do_not_count_their_own_twice() -> None:
    a, b = LatencyModel(), LatencyModel()
    now = feed(a, SLOW, 5_000, 200, 0.0, random.Random(4))
    exported = {k.encode(): v.encode() for k, v in a.export(now).items()}
    b.apply_remote([exported], now)
    assert predict(b, SLOW, 2000, 0, now) == pytest.approx(predict(a, SLOW, 2000, 0, now), 0.01)
    # Applying the same export again replaces it (latest per process), never adds it twice.
    b.apply_remote([exported], now)
    b_described, a_described = b.describe(SLOW, now), a.describe(SLOW, now)
    assert b_described is not None
    assert a_described is not None
    assert b_described["evidence"] == a_described["evidence"]
    # Unreadable entries count as nothing.
    b.apply_remote([{SLOW.encode(): b"[1,2]", FAST.encode(): b"not json"}], now)
    assert b.describe(SLOW, now) is not None


def test_scraped_queue_floors_epps_own_view() -> None:
    """Work other gateways sent shows in the scraped queue: it counts at the size of epp's
    own waiting requests (the request's own size when epp has none there)."""
    busy = EndpointState(FAST, "p", True, EndpointMetrics(waiting=4, running=10))
    features = ttft_features(1000, Load(), busy)
    assert features[2] == pytest.approx(4.0)  # 4 x 1000 tokens, in thousands
    assert features[3] == pytest.approx(1.0)  # 10 decoding, in tens
    own = Load(requests=6, prefill=3000, waiting=6)
    assert ttft_features(1000, own, busy)[2] == pytest.approx(3.0)


def test_the_scorers_prediction_is_the_models() -> None:
    """``predict`` (written out for decision time) agrees with the learned linear model."""
    model = LatencyModel()
    now = feed(model, SLOW, 5_000, 100, 0.0, random.Random(5))
    endpoint = EndpointState(SLOW, "p", True, EndpointMetrics(waiting=2, running=7))
    load = Load(requests=4, prefill=1500, waiting=1)
    ttft, tpot = model.predict(800, load, endpoint, now)
    assert ttft == pytest.approx(model.predict_ttft(SLOW, ttft_features(800, load, endpoint), now))
    assert tpot == pytest.approx(model.predict_tpot(SLOW, 7, now))  # 6 decoding + this one


def test_speeds_keep_only_differences_beyond_noise() -> None:
    """Two generations (20k and 5k tokens/s) are speeds; eight equal replicas whose samples
    scatter by 5% are not: on them the TTFT estimate must count every endpoint as 1."""
    model = LatencyModel()
    rng = random.Random(5)
    now = feed(model, FAST, 20_000, 100, 0.0, rng)
    now = feed(model, SLOW, 5_000, 100, now, rng)
    speeds = model.speeds(now)
    assert speeds[FAST] > 1.25
    assert speeds[SLOW] < 0.8
    assert speeds[FAST] / speeds[SLOW] == pytest.approx(4, rel=0.25)
    equal = LatencyModel()
    now = 0.0
    for i in range(8):
        now = feed(equal, f"10.0.1.{i}:8000", 10_000, 30, now, rng)
    assert len(equal.capacities(now)) == 8
    assert equal.speeds(now) == {}


def test_equal_replicas_waiting_on_what_the_features_miss_get_no_speeds() -> None:
    """Past saturation the TTFTs of equal replicas are mostly waiting for KV blocks, which no
    feature sees (multi-turn 24 req/s: TTFTs of 1-30 s): the prefill slope is not identified
    and the learned capacities scatter far outside the noise band (0.4-20 across the fleet in
    benchmarks/results/learned-latency-history.md). Their standard errors are as wide, so none
    is a speed."""
    rng = random.Random(7)
    model = LatencyModel()
    now = 0.0
    for i in range(8):
        address = f"10.0.1.{i}:8000"
        for _ in range(60):
            uncached = rng.choice((rng.uniform(1900, 2200), rng.uniform(100, 300)))
            load = Load(requests=rng.randrange(10, 40), prefill=int(rng.uniform(0, 20_000)))
            features = ttft_features(uncached, load, EndpointState(address, "p"))
            seconds = truth(10_000, uncached, load.prefill, load.decoding) + rng.uniform(0, 20)
            predicted = model.predict_ttft(address, features, now)
            model.observe_ttft(address, Basis(features, predicted), seconds, now)
            now += 0.05
    capacities = model.capacities(now)
    assert max(capacities.values()) > 2 * SPEED_BAND
    assert min(capacities.values()) < 1 / SPEED_BAND
    assert model.speeds(now) == {}


def test_a_tiny_first_response_does_not_stop_the_endpoint_learning_from_larger_ones() -> None:
    """An endpoint whose first response was a 2-token probe (10 ms) then serves cold 2,300-token
    prompts: its prefill rate comes from those within a few of them, as for an endpoint
    without the probe. Scaled by the evidence's weighted mean, each cold sample weighed
    (0.01 / y)**2 ~ 1e-4 and the endpoint kept the prior's 10k tokens/s for minutes."""
    model = LatencyModel()
    state = EndpointState(FAST, "p")
    probe = ttft_features(2, Load(), state)
    model.observe_ttft(FAST, Basis(probe, 0.0), 0.01, 0.0)
    cold = ttft_features(2300, Load(), state)
    for i in range(5):
        model.observe_ttft(FAST, Basis(cold, 0.0), 0.02 + 2.3 / 4.0, 1.0 + i)
    described = model.describe(FAST, 6.0)
    assert described is not None
    assert described["prefill_tokens_per_second"] == pytest.approx(4_000, rel=0.25)


def test_one_cold_prefill_each_is_enough_to_tell_speeds_apart() -> None:
    """The fleet's first seconds are when most prompts are cached nowhere: a replica's first
    response already counts (the evidence it gives decays from 1 at once, so a bound of one
    whole observation would wait for the second)."""
    model = LatencyModel()
    for address, seconds in ((FAST, 0.45), (SLOW, 0.9)):
        features = ttft_features(2300, Load(), EndpointState(address, "p"))
        model.observe_ttft(address, Basis(features, 0.0), seconds, 1.0)
    speeds = model.speeds(1.5)
    assert speeds[FAST] > 1.25 > 0.8 > speeds[SLOW]
