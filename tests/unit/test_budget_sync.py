"""Tenant budgets shared through a real Redis: two ledgers (two processes' worth) spending one
tenant's budget stay within it together; with Redis down each spends at most its share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from epp.admission.budget_sync import BudgetSync
from epp.admission.budgets import BudgetPolicy, Budgets, Charge, Limits
from epp.observability import BUDGET_LOCAL_MODE, BUDGET_MEMBERS
from epp.state.shared.connect import hash_tag
from epp.state.shared.keys import Keys
from tests.helpers import redis_servers
from tests.unit.conftest import SHARED_URL, eventually

TICK = 0.02
WINDOW = 30.0  # long enough that nothing leaves the window during a test
POLICY = BudgetPolicy(
    {"evals": Limits(rpm=100, tpm=0), "late": Limits(rpm=40)}, window_seconds=WINDOW
)

Member = Callable[..., Awaitable[tuple[Budgets, BudgetSync]]]


@pytest.fixture
async def member(prefix: str) -> AsyncIterator[Member]:
    syncs: list[BudgetSync] = []

    async def start(url: str = SHARED_URL, name: str = "") -> tuple[Budgets, BudgetSync]:
        ledger = Budgets(POLICY)
        sync = BudgetSync(
            url,
            ledger,
            Keys(hash_tag(prefix)),
            name or f"p{len(syncs)}",
            interval=TICK,
            # Membership outlives many late ticks: at 3 ticks (60 ms) a busy machine's delays
            # alone drop a member, and the other's share (limit / members) doubles.
            member_ttl=50 * TICK,
        )
        await sync.start()
        syncs.append(sync)
        return ledger, sync

    yield start
    for sync in syncs:
        await sync.stop()


async def offer(ledgers: list[Budgets], tenant: str, seconds: float) -> list[int]:
    """Each ledger asked for one request of ``tenant`` every 2 ms for ``seconds``; admitted
    counts per ledger."""
    admitted = [0] * len(ledgers)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for i, ledger in enumerate(ledgers):
            if isinstance(ledger.charge(tenant, 1, time.monotonic()), Charge):
                admitted[i] += 1
        await asyncio.sleep(0.002)
    return admitted


async def test_two_processes_admit_the_limit_together_and_no_more(member: Member) -> None:
    (a, _), (b, _) = await member(), await member()
    await eventually(lambda: a.members == 2 and b.members == 2, what="both see the group")
    admitted = await offer([a, b], "evals", 2.0)
    assert 95 <= sum(admitted) <= 100, admitted
    assert min(admitted) > 10, admitted  # both spent from the one budget
    # What stranded in slices went back: the group's window shows what was admitted, and at
    # most the one request's slice the other keeps while its tenant is active.
    left = 100 - sum(admitted)
    await asyncio.sleep(1.5)
    await eventually(
        lambda: left - 1 <= a.remaining("evals", "requests", time.monotonic())[0] <= left,
        what="the returned slices show in the group's window",
    )


async def test_with_redis_down_each_process_spends_at_most_its_share(
    tmp_path: Path, member: Member
) -> None:
    if not redis_servers.available():
        pytest.skip("redis-server not installed")
    server = redis_servers.RedisServer(tmp_path).start()
    try:
        (a, _), (b, _) = await member(server.url), await member(server.url)
        await eventually(lambda: a.members == 2 and b.members == 2, what="both see the group")
        assert BUDGET_MEMBERS._value.get() == 2  # what local mode will divide by, exported
        server.kill()
        await eventually(lambda: not a.shared and not b.shared, what="both notice the outage")
        assert BUDGET_LOCAL_MODE._value.get() == 1
        admitted = await offer([a, b], "late", 0.5)
        assert admitted == [20, 20]  # 40 / 2 processes each, never the whole 40
        no = a.charge("late", 1, time.monotonic())
        assert not isinstance(no, Charge)
        assert no is not None
        assert no.error().headers["x-ratelimit-remaining-requests"] == "0"
        server.start()
        await eventually(lambda: a.shared and b.shared, what="both share again")
        assert BUDGET_LOCAL_MODE._value.get() == 0
        # What was spent meanwhile reached the group's window: the budget is spent.
        await eventually(
            lambda: a.remaining("late", "requests", time.monotonic())[0] == 0,
            what="local spends charged to the group",
        )
    finally:
        server.stop()


async def test_a_new_window_length_starts_the_groups_window_afresh(member: Member) -> None:
    a, _ = await member()
    for _ in range(10):
        assert isinstance(a.charge("evals", 1, time.monotonic()), Charge)
    await eventually(
        lambda: (
            a.remaining("evals", "requests", time.monotonic())[0] <= 90
            and a.accounts()[("evals", "requests")].group is not None
        ),
        what="the group's window holds the 10",
    )
    # Buckets 100 times wider: the old ones mean other times and must not count.
    a.policy = BudgetPolicy({"evals": Limits(rpm=100)}, window_seconds=100 * WINDOW)
    assert isinstance(a.charge("evals", 1, time.monotonic()), Charge)
    await eventually(
        lambda: (
            ("evals", "requests") in a.accounts()
            and a.accounts()[("evals", "requests")].group is not None
            and a.remaining("evals", "requests", time.monotonic())[0] == 99
        ),
        what="only the new request counts",
    )
