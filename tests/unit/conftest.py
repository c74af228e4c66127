"""Fixtures and helpers shared by unit tests (Redis on 6379, waiting for async conditions)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import redis.exceptions
from redis.asyncio import Redis

SHARED_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A key prefix no other test uses; its keys (plain or hash-tagged) are deleted afterwards."""
    client = Redis.from_url(SHARED_URL)
    try:
        await client.ping()
    except redis.exceptions.ConnectionError as exc:
        await client.aclose()
        pytest.skip(f"no Redis at {SHARED_URL}: {exc}")
    name = f"epp-test-{uuid.uuid4().hex[:12]}"
    yield name
    keys = [k async for k in client.scan_iter(match=f"*{name}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def eventually(
    condition: Callable[[], object], within: float = 5.0, what: str = "condition"
) -> float:
    """Seconds until ``condition`` held; fails the test after ``within``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.002)
    return time.monotonic() - started
