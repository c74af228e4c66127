"""GIE's pool gauges and epp's autoscaling signals, computed when Prometheus scrapes.

Nothing here runs on the request path: the gauges are derived on demand from the same snapshot
the picker reads, so an endpoint that left the snapshot leaves the exposition with it (no stale
``model_server_pod`` series to remove). Averages are over the pool's ready endpoints, as the
picker only uses those; a pool without one reports 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.metrics.demand import PoolDemand
from epp.state.snapshot import EndpointState, Snapshot


class PoolGauges(Collector):
    """``inference_pool_*`` families (label ``name``) and ``epp_pool_*`` autoscaling signals
    (label ``pool``, docs/autoscaling.md) for every configured pool."""

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        pools: Callable[[], Mapping[str, object]],
        demand: PoolDemand,
    ) -> None:
        self._snapshot = snapshot
        self._pools = pools
        self._demand = demand

    def collect(self) -> Iterator[Metric]:
        members: dict[str, list[EndpointState]] = {name: [] for name in self._pools()}
        for state in self._snapshot().endpoints.values():
            if state.ready and state.pool in members:
                members[state.pool].append(state)
        ready = GaugeMetricFamily(
            "inference_pool_ready_pods", "Ready endpoints of the pool.", labels=["name"]
        )
        kv = GaugeMetricFamily(
            "inference_pool_average_kv_cache_utilization",
            "Mean KV-cache use (0-1) over the pool's ready endpoints, as last scraped.",
            labels=["name"],
        )
        queue = GaugeMetricFamily(
            "inference_pool_average_queue_size",
            "Mean requests waiting in the model servers' queues over the pool's ready endpoints.",
            labels=["name"],
        )
        per_pod = GaugeMetricFamily(
            "inference_pool_per_pod_queue_size",
            "Requests waiting in each ready endpoint's model-server queue.",
            labels=["name", "model_server_pod"],
        )
        for name, states in sorted(members.items()):
            count = len(states)
            ready.add_metric([name], count)
            kv.add_metric([name], sum(s.metrics.kv_usage for s in states) / count if count else 0)
            waiting = [s.metrics.waiting for s in states]
            queue.add_metric([name], sum(waiting) / count if count else 0)
            for state in states:
                per_pod.add_metric([name, state.address], state.metrics.waiting)
        yield from (ready, kv, queue, per_pod)
        yield from self._signals({name: len(states) for name, states in members.items()})

    def _signals(self, ready: Mapping[str, int]) -> Iterator[Metric]:
        desired = GaugeMetricFamily(
            "epp_pool_desired_replicas",
            "Replicas the pool needs: ceil(arrival rate / (service rate per replica x target "
            "utilisation)), at least 1 while requests wait for a pool with none ready.",
            labels=["pool"],
        )
        arrivals = GaugeMetricFamily(
            "epp_pool_arrival_rate",
            "Requests per second arriving for the pool (decayed over autoscaling.window_seconds).",
            labels=["pool"],
        )
        service = GaugeMetricFamily(
            "epp_pool_service_rate_per_replica",
            "Requests per second one replica completes at replica_concurrency (measured mean "
            "request time); absent until a request of the pool completed.",
            labels=["pool"],
        )
        for name, count in sorted(ready.items()):
            signal = self._demand.signal(name, count)
            desired.add_metric([name], signal.desired_replicas)
            arrivals.add_metric([name], signal.arrival_rate)
            if signal.service_rate_per_replica is not None:
                service.add_metric([name], signal.service_rate_per_replica)
        yield from (desired, arrivals, service)
