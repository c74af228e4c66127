"""The autoscaling signal: desired = ceil(arrival / (service rate per replica x target)), leading
the queue, asking for one replica when requests wait for an empty pool, and 0 when idle."""

from __future__ import annotations

import math
import random

from epp.metrics.demand import DemandPolicy, PoolDemand, _Decayed

POLICY = DemandPolicy(target_utilisation=0.8, replica_concurrency=4, window_seconds=10.0)


def steady(demand: PoolDemand, rate: float, seconds: float, until: float) -> None:
    """``rate`` arrivals per second for ``until`` seconds, each completing in ``seconds``."""
    step = 1.0 / rate
    t = 0.0
    while t < until:
        demand.arrived("p", now=t)
        demand.completed("p", seconds, now=t)
        t += step


def test_desired_follows_littles_law_at_steady_load() -> None:
    demand = PoolDemand(POLICY)
    steady(demand, rate=20.0, seconds=0.5, until=100.0)
    signal = demand.signal("p", ready=2, now=100.0)
    # 20 req/s x 0.5 s = 10 in flight; 4 per replica at 80% -> 10 / 3.2 -> 4 replicas.
    assert abs(signal.arrival_rate - 20.0) < 1.0
    assert signal.service_rate_per_replica is not None
    assert abs(signal.service_rate_per_replica - 8.0) < 1e-6
    assert signal.desired_replicas == math.ceil(20.0 / (8.0 * 0.8)) == 4


def test_doubling_the_load_doubles_desired_within_a_window() -> None:
    demand = PoolDemand(POLICY)
    steady(demand, rate=10.0, seconds=0.5, until=100.0)
    before = demand.signal("p", ready=2, now=100.0).desired_replicas
    t = 100.0
    while t < 110.0:  # one window of twice the arrivals, same service time
        demand.arrived("p", now=t)
        demand.completed("p", 0.5, now=t)
        t += 0.05
    after = demand.signal("p", ready=2, now=110.0).desired_replicas
    assert before == 2
    assert after >= 3


def test_a_request_waiting_for_an_empty_pool_asks_for_one_replica() -> None:
    demand = PoolDemand(POLICY)
    demand.arrived("p", now=0.0)  # refused: no ready replica, nothing ever completed
    assert demand.signal("p", ready=0, now=1.0).desired_replicas == 1
    # Idle after about window * ln 2 without arrivals: desired drops to 0.
    assert demand.signal("p", ready=0, now=10.0).desired_replicas == 0


def test_unknown_and_forgotten_pools_ask_for_nothing() -> None:
    demand = PoolDemand(POLICY)
    steady(demand, rate=5.0, seconds=0.1, until=10.0)
    demand.forget(set())
    assert demand.signal("p", ready=3, now=10.0).desired_replicas == 0


def test_completions_decay_as_two_separately_decayed_sums_would() -> None:
    """``completed`` decays both sums by one shared factor: the same floats as decaying each
    on its own (they are always updated at the same instants)."""
    rng = random.Random(7)
    demand = PoolDemand(DemandPolicy(window_seconds=30.0))
    completions, busy = _Decayed(), _Decayed()
    now = 100.0
    for _ in range(500):
        now += rng.expovariate(5.0)
        seconds = rng.uniform(0.01, 3.0)
        demand.completed("p", seconds, now)
        completions.add(1.0, now, 30.0)
        busy.add(seconds, now, 30.0)
    state = demand._pools["p"]
    assert (state.completions.value, state.busy.value) == (completions.value, busy.value)
