"""Response hook: a tenant's budget is charged what the response used (docs/admission.md)."""

from __future__ import annotations

from epp.admission.budgets import Budgets
from epp.lifecycle import Finished


class BudgetCorrection:
    """Admission charged an estimate of the request's tokens; its usage corrects it."""

    name = "budget-correction"

    def __init__(self, budgets: Budgets) -> None:
        self._budgets = budgets

    def finished(self, done: Finished) -> None:
        usage = done.outcome.usage
        if done.charge is not None and usage is not None:
            self._budgets.correct(done.charge, usage.prompt + usage.completion)
