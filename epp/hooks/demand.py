"""Response hook: each pool's service rate for the autoscaling signals (docs/autoscaling.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from epp.lifecycle import Finished
from epp.metrics.demand import PoolDemand


class ServiceRate:
    """A completed response counts its replica's time after the first token (the time
    before it is mostly the queue, which must not inflate the service time) toward its pool's
    rate. ``pools`` maps each current endpoint to its pool."""

    name = "service-rate"

    def __init__(self, demand: PoolDemand, pools: Callable[[], Mapping[str, str]]) -> None:
        self._demand = demand
        self._pools = pools

    def finished(self, done: Finished) -> None:
        outcome = done.outcome
        if outcome.served is None or not outcome.complete or outcome.status >= 400:
            return
        pool = self._pools().get(outcome.served)
        if pool is not None:
            self._demand.completed(pool, outcome.seconds - (outcome.ttft or 0.0))
