"""The error fault fails an evenly spread share of requests, the same on every machine."""

from __future__ import annotations

import itertools

import pytest

from epp.sim.faults import Faults


def outcomes(rate: float, n: int) -> list[bool]:
    faults = Faults()
    faults.update({"error_rate": rate})
    return [faults.should_fail() for _ in range(n)]


@pytest.mark.parametrize("rate", [0.0, 0.2, 0.25, 0.5, 0.7, 1.0])
def test_exactly_the_share_fails_in_every_window(rate: float) -> None:
    fails = outcomes(rate, 200)
    assert sum(fails) == int(200 * rate)
    # Every run of 20 requests holds the share to within one request: no clusters.
    for start in range(0, 180):
        assert abs(sum(fails[start : start + 20]) - 20 * rate) <= 1


def test_at_one_half_no_two_requests_in_a_row_succeed() -> None:
    fails = outcomes(0.5, 100)
    assert not any(not a and not b for a, b in itertools.pairwise(fails))


def test_setting_a_new_rate_starts_the_pattern_again() -> None:
    faults = Faults()
    faults.update({"error_rate": 0.5})
    first = [faults.should_fail() for _ in range(3)]
    faults.update({"latency_ms": 10})  # the rate unchanged: the pattern goes on
    assert faults.should_fail() == (not first[-1])
    faults.update({"error_rate": 0.25})
    assert [faults.should_fail() for _ in range(4)] == [False, False, False, True]
