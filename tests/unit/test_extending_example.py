"""The worked example of docs/extending.md: a stateful, replicated scorer kept in one folder
(tests/unit/extending/), configured by name, routing requests in two epp processes whose
state travels through the real Redis."""

from __future__ import annotations

from typing import Any

import pytest

from epp.config import parse_config
from epp.request import InferenceRequest
from epp.router import Router
from epp.state import EndpointState
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from epp.state.shared import wire
from epp.state.shared.sync import SharedState
from tests.unit.conftest import SHARED_URL, eventually
from tests.unit.extending.least_picked import PICKS, PickCounts, Picked

POOL = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
CONFIG: dict[str, Any] = {
    "models": {"tiny": {"pools": ["main"]}},
    "pools": {"main": {"endpoints": [{"address": a} for a in POOL]}},
    "scheduling": {
        "profile": "spread",
        "profiles": {
            "spread": [
                {"plugin": "least-picked-scorer"},
                {"plugin": "max-score-picker"},
            ]
        },
    },
}


async def member(prefix: str) -> tuple[Router, SharedState]:
    """One epp process: its router (configured with the example plugin) and its sync loop."""
    store = MemoryStore()
    for address in POOL:
        await store.put_endpoint(EndpointState(address, "main", True, scraped_at=1.0))
    fleet = FleetState(store)
    router = Router(parse_config(CONFIG), fleet)
    shared = SharedState(SHARED_URL, fleet, key_prefix=prefix, interval=0.02)
    shared.set_endpoints(POOL)
    await shared.start()
    return router, shared


def route(router: Router) -> str:
    request = InferenceRequest("id", "/v1/completions", "completions", "tiny", "hello")
    decision, ticket = router.route(request)
    router.fleet.inflight.release(ticket)
    return decision.endpoints[0].address


async def test_the_example_state_is_declared_used_and_replicated(prefix: str) -> None:
    (a, shared_a), (b, shared_b) = await member(prefix), await member(prefix)
    try:
        # Applying the configuration declared the plugin's state in both processes.
        counts_a, counts_b = a.fleet.states.get(PICKS), b.fleet.states.get(PICKS)
        assert isinstance(counts_a, PickCounts)
        assert counts_a is not counts_b
        first, second = route(a), route(a)
        assert first != second  # a's own picks spread
        assert counts_a.counts == {first: 1, second: 1}
        # b learns a's picks through Redis, not from any request of its own...
        await eventually(lambda: counts_b.counts == counts_a.counts, what="a's picks at b")
        # ...so b's first request goes to the one endpoint the group has not picked yet.
        (third,) = set(POOL) - {first, second}
        assert route(b) == third
        await eventually(lambda: counts_a.counts[third] == 1, what="b's pick at a")
    finally:
        await shared_a.stop()
        await shared_b.stop()


def test_items_beyond_the_bounds_are_refused() -> None:
    assert PICKS.replicated is not None
    check = PICKS.replicated.check
    assert check(Picked("x", 3), 0.0) == Picked("x", 3)
    for count in (0, 10_000):
        with pytest.raises(wire.Malformed):
            check(Picked("x", count), 0.0)
