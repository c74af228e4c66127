"""Cluster-wide flow control through a real Redis: two flow controllers, each with its own
fleet state and shared-state loop (two epp processes in one event loop), in front of one pool.

The pool is a slot count both controllers read, as the shared in-flight counts let them: a slot
freed by one process's request is visible to that process at once (and it is woken, as the
response path wakes the real one) and to the other one exchange interval later. Without the
group's view the first process fills the slot from its own queue, whatever waits in the other."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from epp.admission.controller import FlowController
from epp.admission.flow_queue import BandLimits, QueueLimits
from epp.state.fleet import FleetState
from epp.state.shared.sync import SharedState
from tests.helpers import redis_servers
from tests.unit.conftest import SHARED_URL, eventually

TICK = 0.05
LIMITS = QueueLimits(1000, BandLimits(1000, 120.0))


class Pool:
    """``capacity`` slots shared by every controller; ``taken`` counts dispatched requests."""

    def __init__(self, capacity: int, taken: int = 0) -> None:
        self.capacity = capacity
        self.taken = taken
        # Slots freed recently: (when the other processes see it, the process that freed it).
        self._unseen: list[tuple[float, FlowController]] = []

    def free(self, by: FlowController) -> None:
        """A request of ``by`` finished: ``by`` sees the slot now, the others a tick later."""
        self.taken -= 1
        self._unseen.append((asyncio.get_running_loop().time() + TICK, by))
        by.wake()

    def saturated(self, viewer: FlowController) -> bool:
        now = asyncio.get_running_loop().time()
        self._unseen = [(t, by) for t, by in self._unseen if t > now]
        unseen = sum(1 for _, by in self._unseen if by is not viewer)
        return self.taken + unseen >= self.capacity


Process = tuple[FlowController, FleetState]
Start = Callable[..., Awaitable[Process]]


@pytest.fixture
async def processes(prefix: str) -> AsyncIterator[Start]:
    shared: list[SharedState] = []

    async def start(pool: Pool, url: str = SHARED_URL, group: bool = True) -> Process:
        fleet = FleetState()
        member = SharedState(url, fleet, key_prefix=prefix, interval=TICK)
        await member.start()
        shared.append(member)
        flow = FlowController(
            LIMITS, lambda _key, _sheddable: pool.saturated(flow), group=fleet.queues
        )
        flow.use_group = group
        return flow, fleet

    yield start
    for member in shared:
        await member.stop()


async def _held(
    flow: FlowController, pool: Pool, priority: int, fairness: str, order: list[str]
) -> None:
    """One request: held until dispatched, then it takes a slot (and records its name)."""
    await flow.admit("m", priority, fairness)
    pool.taken += 1
    order.append(fairness)


@pytest.mark.parametrize("scope", ["group", "local"])
async def test_critical_held_on_one_epp_goes_before_batch_held_on_another(
    processes: Start, scope: str
) -> None:
    pool = Pool(capacity=1, taken=1)
    grouped = scope == "group"
    (a, _), (b, fb) = await processes(pool, group=grouped), await processes(pool, group=grouped)
    order: list[str] = []
    critical = asyncio.create_task(_held(a, pool, 10, "chat", order))
    batch = asyncio.create_task(_held(b, pool, -1, "evals", order))
    await eventually(lambda: a.queued() == 1 and b.queued() == 1, what="both held")
    await eventually(lambda: fb.queues.waiting("m", 10, asyncio.get_running_loop().time()))
    # b's request finishes: b sees the free slot first.
    pool.free(b)
    await eventually(lambda: order, what="a dispatch")
    if scope == "local":
        # Each epp orders only its own queue: b fills the slot with batch work.
        assert order == ["evals"]
        critical.cancel()
        await asyncio.gather(critical, batch, return_exceptions=True)
        return
    assert order == ["chat"]
    assert not batch.done()
    # The next free slot goes to batch: nothing of a higher band waits anywhere.
    pool.free(b)
    await asyncio.wait_for(batch, 5)
    assert order == ["chat", "evals"]
    await critical


async def test_a_tenant_reaching_two_epps_gets_no_more_than_one_reaching_one(
    processes: Start,
) -> None:
    """heavy waits on both epps, light only on a; each finished request frees its slot on the
    epp that dispatched it. Shares measured over dispatches while both always have work."""
    pool = Pool(capacity=2)
    (a, _), (b, _) = await processes(pool), await processes(pool)
    rng = random.Random(3)
    order: list[str] = []
    running: set[asyncio.Task[None]] = set()

    async def serve(flow: FlowController, fairness: str) -> None:
        await flow.admit("m", 0, fairness)
        pool.taken += 1
        order.append(fairness)
        await asyncio.sleep(rng.uniform(0.1, 0.2))
        pool.free(flow)
        if len(order) < 60:
            start(flow, fairness)  # a closed loop: the client sends its next request

    def start(flow: FlowController, fairness: str) -> None:
        task = asyncio.create_task(serve(flow, fairness))
        running.add(task)
        task.add_done_callback(running.discard)

    # Interleaved, so each epp takes one of the two slots first (as an even load balancer
    # would have it): a slot then stays with the epp that frees it, which sees it first.
    for _ in range(4):
        for flow, fairness in [(a, "heavy"), (b, "heavy"), (a, "light")]:
            start(flow, fairness)
    await eventually(lambda: len(order) >= 60, within=60, what="60 dispatches")
    for task in list(running):
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    shares = Counter(order[:60])
    # Alone, each epp would split its own slots: heavy 3/4, light 1/4 (45 against 15).
    assert shares["light"] >= 0.8 * shares["heavy"], shares


def _group_gauge() -> float:
    return REGISTRY.get_sample_value("epp_flow_control_group") or 0.0


async def test_with_redis_down_each_epp_orders_its_own_queue_and_says_so(
    tmp_path: Path, processes: Start, caplog: pytest.LogCaptureFixture
) -> None:
    if not redis_servers.available():
        pytest.skip("redis-server not installed")
    server = redis_servers.RedisServer(tmp_path).start()
    try:
        pool = Pool(capacity=1, taken=1)
        (a, _fa), (b, fb) = await processes(pool, server.url), await processes(pool, server.url)
        now = asyncio.get_running_loop().time
        order: list[str] = []
        critical = asyncio.create_task(_held(a, pool, 10, "chat", order))
        await eventually(lambda: fb.queues.waiting("m", 10, now()), what="b sees a's queue")
        assert _group_gauge() == 1

        caplog.set_level(logging.WARNING, logger="epp.state.shared.sync")
        server.kill()
        await eventually(lambda: not fb.queues.live(now()), what="b notices the outage")
        await eventually(lambda: _group_gauge() == 0, what="the gauge says local")
        assert any(
            "fairness shares hold for this process only" in r.message for r in caplog.records
        )
        # Local control: b's batch takes the slot it freed at once; it does not yield to a
        # queue it can no longer see.
        yields = _yields()
        batch = asyncio.create_task(_held(b, pool, -1, "evals", order))
        await eventually(lambda: b.queued() == 1, what="batch held")
        pool.free(b)
        await asyncio.wait_for(batch, 5)
        assert order == ["evals"]
        assert _yields() == yields

        server.start()  # empty: the group's view comes back with the next ticks
        await eventually(lambda: fb.queues.waiting("m", 10, now()), within=10, what="group again")
        assert _group_gauge() == 1
        # Group control again: the next batch yields the slot to a's critical request.
        batch = asyncio.create_task(_held(b, pool, -1, "evals", order))
        await eventually(lambda: b.queued() == 1, what="batch held again")
        pool.free(b)
        await asyncio.wait_for(critical, 5)
        assert order == ["evals", "chat"]
        assert not batch.done()
        assert _yields() == yields + 1
        batch.cancel()
        await asyncio.gather(batch, return_exceptions=True)
    finally:
        server.stop()


def _yields() -> float:
    return REGISTRY.get_sample_value("epp_flow_control_yields_total", {"inference_pool": "m"}) or 0
