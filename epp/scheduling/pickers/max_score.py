"""Highest total score wins; ties are broken at random so equal endpoints share the load."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from epp.scheduling.framework import Picker, register
from epp.scheduling.params import Params, param
from epp.state.snapshot import EndpointState


@dataclass(frozen=True, slots=True)
class MaxScoreParams(Params):
    """``seed``: fixes the tie-break order (tests, reproducible benchmarks)."""

    seed: int | None = param(None)


@register("max-score-picker")
class MaxScorePicker(Picker):
    params_type = MaxScoreParams

    def __init__(self, params: MaxScoreParams = MaxScoreParams()) -> None:
        self._random = random.Random(params.seed)

    def pick(
        self, candidates: Sequence[EndpointState], totals: Sequence[float], count: int
    ) -> list[EndpointState]:
        # A random secondary key orders ties randomly; fallbacks come from the same ranking.
        # The keys are built first, one draw per candidate in candidate order, as sorted()
        # would draw them through a key function (the same ranking for the same seed).
        rand = self._random.random
        keys = [(-total, rand()) for total in totals]
        ranked = sorted(range(len(candidates)), key=keys.__getitem__)
        return [candidates[i] for i in ranked[:count]]
