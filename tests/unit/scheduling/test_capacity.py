"""capacity-scorer: configured endpoint weights, normalised to the largest candidate."""

from __future__ import annotations

from epp.scheduling.scorers.capacity import CapacityScorer
from tests.unit.scheduling.common import cycle, ep, req


def test_scores_are_weights_over_the_largest() -> None:
    c = cycle(weights={"a": 4.0, "b": 2.0})
    assert CapacityScorer().score(req("p"), [ep("a"), ep("b"), ep("c")], c) == [1.0, 0.5, 0.25]


def test_largest_among_candidates_scores_one() -> None:
    c = cycle(weights={"a": 4.0, "b": 2.0})
    assert CapacityScorer().score(req("p"), [ep("b"), ep("c")], c) == [1.0, 0.5]


def test_unweighted_fleet_scores_one_everywhere() -> None:
    assert CapacityScorer().score(req("p"), [ep("a"), ep("b")], cycle()) == [1.0, 1.0]
