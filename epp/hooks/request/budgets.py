"""Admission hook: a request is charged to its tenant's budget (docs/admission.md)."""

from __future__ import annotations

import time

from epp.admission.budgets import Budgets, Refusal
from epp.lifecycle import Hold, RequestContext
from epp.observability import BUDGET_ADMITTED, BUDGET_REFUSED, BUDGET_REMAINING, child
from epp.request import InferenceRequest


class BudgetCharge:
    """Spends one request and its expected tokens from the tenant's budget, or refuses it with
    the 429 that names the budget that ran out; a request that never runs is refunded."""

    name = "budget"

    def __init__(self, budgets: Budgets) -> None:
        self._budgets = budgets

    def admit(self, context: RequestContext, request: InferenceRequest) -> Hold | None:
        tenant = request.fairness_id
        verdict = self._budgets.charge(tenant, request.expected_tokens(), time.monotonic())
        if verdict is None:
            return None
        label = context.generation.config.budgets.label(tenant)
        for kind in ("requests", "tokens"):
            remaining = verdict.headers.get(f"x-ratelimit-remaining-{kind}")
            if remaining is not None:
                child(BUDGET_REMAINING, label, kind).set(float(remaining))
        if isinstance(verdict, Refusal):
            child(BUDGET_REFUSED, label, verdict.kind).inc()
            raise verdict.error()
        child(BUDGET_ADMITTED, label).inc()
        context.admission.charge = verdict
        return None

    def withdraw(self, context: RequestContext) -> None:
        charge = context.admission.charge
        if charge is not None:
            self._budgets.refund(charge)
            context.admission.charge = None
