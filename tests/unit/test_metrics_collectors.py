"""The scrape-time metrics: GIE's pool gauges from a snapshot (an endpoint that left takes its
series with it) and the scheduler's per-plugin timing."""

from __future__ import annotations

import itertools
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epp.metrics.demand import PoolDemand
from epp.metrics.plugin_clock import BUCKETS, FOLD_EVERY, TIMING, Lap, PluginClock, Tally
from epp.metrics.pool_gauges import PoolGauges
from epp.scheduling.scorers.load import InflightLoadParams
from epp.scheduling.scorers.prefix import PrefixParams
from epp.state import EndpointMetrics, EndpointState, Snapshot
from tests.unit.scheduling.common import cycle, ep, profile_of, req


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def state(address: str, pool: str, ready: bool, waiting: int, kv: float) -> EndpointState:
    return EndpointState(address, pool, ready, EndpointMetrics(waiting=waiting, kv_usage=kv), 1.0)


def test_pool_gauges_average_ready_endpoints_and_drop_those_that_left() -> None:
    current = Snapshot(
        {
            "a1": state("a1", "a", True, 2, 0.5),
            "a2": state("a2", "a", True, 4, 0.7),
            "a3": state("a3", "a", False, 50, 1.0),  # unready: not routed to, not averaged
        }
    )
    registry = CollectorRegistry()
    registry.register(PoolGauges(lambda: current, lambda: {"a": (), "b": ()}, PoolDemand()))
    got = samples(registry)
    assert got[("inference_pool_ready_pods", (("name", "a"),))] == 2
    assert got[("inference_pool_ready_pods", (("name", "b"),))] == 0
    assert got[("inference_pool_average_queue_size", (("name", "a"),))] == 3
    assert got[("inference_pool_average_queue_size", (("name", "b"),))] == 0
    kv = got[("inference_pool_average_kv_cache_utilization", (("name", "a"),))]
    assert abs(kv - 0.6) < 1e-9
    per_pod = "inference_pool_per_pod_queue_size"
    assert got[(per_pod, (("model_server_pod", "a2"), ("name", "a")))] == 4
    assert (per_pod, (("model_server_pod", "a3"), ("name", "a"))) not in got

    current = Snapshot({"a1": current.endpoints["a1"]})  # a2 left the pool
    got = samples(registry)
    assert (per_pod, (("model_server_pod", "a2"), ("name", "a"))) not in got
    assert got[("inference_pool_ready_pods", (("name", "a"),))] == 1


def _count(name: str, **labels: str) -> float:
    registry = CollectorRegistry()
    registry.register(TIMING)
    want = tuple(sorted(labels.items()))
    return samples(registry).get((name, want), 0.0)


def test_every_plugin_of_a_run_is_timed_once() -> None:
    profile = profile_of(("inflight-load-scorer", InflightLoadParams(), 1.0))
    scorer = ("extension_point", "scorer"), ("plugin_name", "inflight-load-scorer")
    labels = dict((*scorer, ("plugin_type", "inflight-load-scorer")))
    picker = {
        "extension_point": "picker",
        "plugin_name": "max-score-picker",
        "plugin_type": "max-score-picker",
    }
    before = (
        _count("llm_d_epp_scheduler_e2e_duration_seconds_count"),
        _count("llm_d_epp_plugin_duration_seconds_count", **labels),
        _count("llm_d_epp_plugin_duration_seconds_count", **picker),
    )
    decision = profile.run(req(), [ep("a"), ep("b")], cycle(), 1)
    assert len(decision.endpoints) == 1
    after = (
        _count("llm_d_epp_scheduler_e2e_duration_seconds_count"),
        _count("llm_d_epp_plugin_duration_seconds_count", **labels),
        _count("llm_d_epp_plugin_duration_seconds_count", **picker),
    )
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 1]
    assert _count("llm_d_epp_scheduler_e2e_duration_seconds_sum") > 0


def test_a_plugin_at_several_extension_points_is_timed_at_each() -> None:
    """The prefix scorer produces hashes, scores and records its pick: three laps, each
    counted under its own extension point (not all under the last one registered)."""
    profile = profile_of(("prefix-cache-scorer", PrefixParams(), 1.0))
    points = ("producer", "scorer", "post_pick")

    def counts() -> list[float]:
        return [
            _count(
                "llm_d_epp_plugin_duration_seconds_count",
                extension_point=point,
                plugin_name="prefix-cache-scorer",
                plugin_type="prefix-cache-scorer",
            )
            for point in points
        ]

    before = counts()
    laps: list[Lap] = []
    profile.run(req(), [ep("a"), ep("b")], cycle(), 1, laps=laps)
    assert [b - a for a, b in zip(before, counts(), strict=True)] == [1, 1, 1]
    # A traced run hands the same laps to its trace, in order, with their points.
    prefix = [point for point, plugin, _, _ in laps if plugin.name == "prefix-cache-scorer"]
    assert prefix == list(points)
    assert all(start <= end for _, _, start, end in laps)


def test_laps_are_counted_in_bulk_into_the_buckets_prometheus_would_use() -> None:
    """A lap only records its duration; counting them later (every FOLD_EVERY runs and at
    each scrape) puts each in the first bucket whose bound is >= it, as ``le`` says."""
    tally = Tally()
    durations = [0.0, *BUCKETS, 0.00001 * 1.5, 0.003, 7.0, 0.0000001]
    for seconds in durations:
        tally.pending.append(seconds)
    expected = [0] * (len(BUCKETS) + 1)
    for seconds in durations:
        first = next((i for i, bound in enumerate(BUCKETS) if seconds <= bound), len(BUCKETS))
        expected[first] += 1
    cumulative = tally.buckets()
    assert not tally.pending
    assert [count for _, count in cumulative] == list(itertools.accumulate(expected))
    assert tally.total == sum(durations)
    assert cumulative[-1] == ("+Inf", len(durations))


def test_pending_laps_stay_bounded_without_scrapes() -> None:
    clock = PluginClock([])
    for _ in range(FOLD_EVERY + 10):
        clock.stop(time.perf_counter())
    assert len(TIMING.e2e.pending) < FOLD_EVERY
