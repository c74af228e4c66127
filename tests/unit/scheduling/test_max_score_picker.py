"""The max-score picker's ranking, against its definition: highest total first, ties in the
order of one random draw per candidate (drawn in candidate order), fallbacks from the same
ranking; equal seeds give equal rankings."""

from __future__ import annotations

import random

from epp.scheduling.pickers.max_score import MaxScoreParams, MaxScorePicker
from epp.state import EndpointState


def test_ranking_matches_its_definition_draw_for_draw() -> None:
    rng = random.Random(3)
    picker = MaxScorePicker(MaxScoreParams(seed=11))
    reference = random.Random(11)
    for _ in range(300):
        count = rng.randint(1, 6)
        candidates = [EndpointState(f"10.0.0.{i}:8000", "p") for i in range(count)]
        # Few distinct totals, so ties are common.
        totals = [rng.choice((0.0, 0.5, 1.0, 1.5)) for _ in candidates]
        wanted = rng.randint(1, count)
        draws = [reference.random() for _ in candidates]
        ranked = sorted(range(count), key=lambda i: (-totals[i], draws[i]))
        expected = [candidates[i] for i in ranked[:wanted]]
        assert picker.pick(candidates, totals, wanted) == expected
