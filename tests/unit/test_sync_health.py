"""Passive-health ejections shared through a real Redis: one process observes, the others
exclude; with Redis down each process goes on deciding alone, and its verdicts follow later."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from epp.state.fleet import FleetState
from epp.state.health import Circuit, HealthConfig
from epp.state.shared.sync import SharedState
from tests.helpers import redis_servers
from tests.unit.conftest import SHARED_URL, eventually

TICK = 0.02
# An interval no test outlasts: what arrives under it was pushed, not carried by a tick.
NEVER = 3600.0
POOL = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
BAD = POOL[0]
CONFIG = HealthConfig(consecutive_failures=3, base_ejection_seconds=30.0, trial_successes=1)

Group = Callable[..., Awaitable[tuple[FleetState, SharedState]]]


@pytest.fixture
async def group(prefix: str) -> AsyncIterator[Group]:
    members: list[SharedState] = []

    async def start(
        url: str = SHARED_URL, interval: float = TICK
    ) -> tuple[FleetState, SharedState]:
        fleet = FleetState()
        fleet.health.configure(CONFIG, POOL)
        member = SharedState(url, fleet, key_prefix=prefix, interval=interval)
        member.set_endpoints(POOL)
        await member.start()
        members.append(member)
        return fleet, member

    yield start
    for member in members:
        await member.stop()


def fail(fleet: FleetState, times: int) -> None:
    for _ in range(times):
        fleet.health.observe(BAD, "main", POOL, True, None, time.time(), "5xx")


async def test_an_ejection_observed_by_one_process_is_enforced_by_the_other(group: Group) -> None:
    # Verdicts are pushed, not carried by a tick: with ticks an hour apart they still arrive.
    (fa, _), (fb, _) = await group(interval=NEVER), await group(interval=NEVER)
    fail(fa, 3)
    assert not fa.health.admits(BAD, time.time())
    await eventually(lambda: not fb.health.admits(BAD, time.time()), what="b excludes")
    state = fb.health.state(BAD)
    assert state is not None
    assert state.reason == "consecutive"
    # b saw no failure of its own: the verdict is the only way it can know.
    assert len(state.outcomes) == 0
    # The readmission travels back the same way: b's trial succeeds once the time has passed.
    state.until = time.time()  # b's copy expires now (half-open at b)
    fb.health.picked(BAD, time.time())
    fb.health.observe(BAD, "main", POOL, False, 0.01, time.time())
    await eventually(lambda: fa.health.admits(BAD, time.time()), what="a readmits")
    a_state = fa.health.state(BAD)
    assert a_state is not None
    assert a_state.circuit(time.time()) is Circuit.CLOSED


async def test_with_redis_down_each_process_decides_alone_and_catches_up(
    tmp_path: Path, group: Group
) -> None:
    if not redis_servers.available():
        pytest.skip("redis-server not installed")
    server = redis_servers.RedisServer(tmp_path).start()
    try:
        (fa, a), (fb, _) = await group(server.url), await group(server.url)
        server.kill()
        await eventually(lambda: a.leases.owned() is None, what="a notices the outage")
        fail(fa, 3)  # decided locally, at once
        assert not fa.health.admits(BAD, time.time())
        assert fb.health.admits(BAD, time.time())
        server.start()
        await eventually(lambda: not fb.health.admits(BAD, time.time()), what="b catches up")
    finally:
        server.stop()
