"""Response hooks: what a finished response teaches epp (:mod:`epp.lifecycle`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from epp.admission.budgets import Budgets
from epp.hooks.budgets import BudgetCorrection
from epp.hooks.demand import ServiceRate
from epp.hooks.latency import LatencyLearning
from epp.hooks.metrics import ResponseMetrics
from epp.hooks.passive_health import PassiveHealth, Pools
from epp.lifecycle import Lifecycle
from epp.metrics.demand import PoolDemand
from epp.state.fleet import FleetState

__all__ = ["LatencyLearning", "standard_lifecycle"]


def standard_lifecycle(
    fleet: FleetState,
    budgets: Budgets,
    demand: PoolDemand,
    endpoint_pools: Callable[[], Mapping[str, str]],
    pools: Pools,
) -> tuple[Lifecycle, LatencyLearning]:
    """Every built-in response hook, in the order they run, and the latency learner (the
    stream also calls it at the first token)."""
    learning = LatencyLearning(fleet)
    hooks = (
        ResponseMetrics(),
        BudgetCorrection(budgets),
        ServiceRate(demand, endpoint_pools),
        learning,
        PassiveHealth(fleet.health, pools, fleet.latency),
    )
    return Lifecycle(hooks), learning
