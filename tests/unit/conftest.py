"""Fixtures shared by unit tests that talk to the Redis every machine runs on 6379."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

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
