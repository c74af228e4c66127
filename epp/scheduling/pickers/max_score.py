"""Highest total score wins; ties are broken at random so equal endpoints share the load."""

from __future__ import annotations

import random
from collections.abc import Sequence

from epp.scheduling.framework import Picker, register
from epp.state.snapshot import EndpointState


@register("max-score-picker")
class MaxScorePicker(Picker):
    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def pick(
        self, candidates: Sequence[EndpointState], totals: Sequence[float], count: int
    ) -> list[EndpointState]:
        # A random secondary key orders ties randomly; fallbacks come from the same ranking.
        rand = self._random.random
        ranked = sorted(range(len(candidates)), key=lambda i: (-totals[i], rand()))
        return [candidates[i] for i in ranked[:count]]
