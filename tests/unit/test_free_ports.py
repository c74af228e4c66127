"""Free ports for stacks: a port handed out is never handed out again before it is bound."""

from __future__ import annotations

import pytest

from epp import devstack
from epp.devstack import free_port, free_port_run


def test_ports_promised_but_not_bound_are_not_handed_out_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stack picks all its ports before binding any. With only 40 ports to choose from, 30
    picks without the promise list would repeat one almost surely (birthday odds > 99.9%)."""
    monkeypatch.setattr(devstack, "_PORT_RUNS", (27000, 27041))
    monkeypatch.setattr(devstack, "_promised", type(devstack._promised)(maxlen=4000))
    picks = [free_port() for _ in range(30)]
    assert len(set(picks)) == 30
    assert all(27000 <= p < 27041 for p in picks)


def test_single_ports_avoid_a_promised_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half the range is a run handed out for simulated replicas; ten more picks, each of
    which would land in it half the time without the promise list, all stay outside it."""
    monkeypatch.setattr(devstack, "_PORT_RUNS", (27100, 27125))
    monkeypatch.setattr(devstack, "_promised", type(devstack._promised)(maxlen=4000))
    base = free_port_run(10)
    run = set(range(base, base + 10))
    singles = {free_port() for _ in range(10)}
    assert len(singles) == 10
    assert not singles & run
