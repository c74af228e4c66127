"""Request hooks: admission, from the parsed request to a request the scheduler may route
(:class:`epp.lifecycle.Admission`)."""

from __future__ import annotations

from epp.admission.budgets import Budgets
from epp.admission.controller import FlowController
from epp.admission.room import Room
from epp.hooks.request.budgets import BudgetCharge
from epp.hooks.request.flow import Arrived, FlowHold
from epp.hooks.request.shed import Shed
from epp.hooks.request.spill import Spill
from epp.lifecycle import Admission
from epp.state.fleet import FleetState

__all__ = ["Arrived", "standard_admission"]


def standard_admission(
    fleet: FleetState, budgets: Budgets, flow: FlowController, room: Room, arrived: Arrived
) -> Admission:
    """Every built-in admission hook, in the order they run: a request is charged to its
    tenant's budget, spilled when its pool is saturated and it may spill, held by flow control
    (``queue``) or refused when sheddable (``shed``)."""
    return Admission(
        (
            BudgetCharge(budgets),
            Spill(fleet, room),
            FlowHold(flow, room, arrived),
            Shed(fleet, room, arrived),
        )
    )
