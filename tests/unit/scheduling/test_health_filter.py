"""The health filter: ejected endpoints are out, half-open ones take one trial at a time, and
when every candidate is ejected none is dropped. Every profile gets it."""

from __future__ import annotations

from epp.scheduling.filters.health import HealthFilter
from epp.scheduling.framework import create_plugin
from epp.scheduling.params import NoParams
from epp.state.fleet import FleetState
from epp.state.health import HealthConfig
from tests.unit.scheduling.common import cycle, ep, profile_of, req

POOL = ("a", "b", "c")


def ejected(*addresses: str, now: float = 1000.0) -> FleetState:
    fleet = FleetState()
    config = HealthConfig(consecutive_failures=1, max_ejection_percent=100)
    fleet.health.configure(config, POOL)
    for address in addresses:
        fleet.health.observe(address, "pool", POOL, True, None, now, "5xx")
    return fleet


def run(fleet: FleetState, now: float, *addresses: str) -> list[str]:
    plugin = create_plugin("health-filter", "health-filter")
    assert isinstance(plugin, HealthFilter)
    kept = plugin.filter(req("x"), [ep(a) for a in addresses], cycle(fleet, now=now))
    return [c.address for c in kept]


def test_an_ejected_endpoint_is_filtered_out_until_its_half_open_trial() -> None:
    fleet = ejected("a")
    assert run(fleet, 1001.0, *POOL) == ["b", "c"]
    # Half-open after the base ejection time (5 s): one trial may go.
    assert run(fleet, 1005.0, *POOL) == ["a", "b", "c"]
    fleet.health.picked("a", 1005.0)
    assert run(fleet, 1005.6, *POOL) == ["b", "c"]


def test_when_every_candidate_is_ejected_all_are_kept() -> None:
    fleet = ejected("a", "b")  # the cap keeps "c" in, but another filter may have dropped it
    assert run(fleet, 1001.0, "a", "b") == ["a", "b"]


def test_every_profile_gets_the_health_filter_after_readiness() -> None:
    profile = profile_of(("queue-scorer", NoParams(), 1.0))
    assert [f.name for f in profile.filters] == ["ready-endpoint-filter", "health-filter"]
    fleet = ejected("a")
    picked = {
        profile.run(req("x"), [ep(a) for a in POOL], cycle(fleet, now=1001.0), 1)
        .endpoints[0]
        .address
        for _ in range(20)
    }
    assert "a" not in picked
