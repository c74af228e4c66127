"""The one Redis connection layer: every client gets epp's timeouts unless its URL says
otherwise, and every loop backs off the same way."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from epp.state.shared import client
from epp.state.shared.client import MAX_BACKOFF, SOCKET_TIMEOUT, Backoff, open_client


async def test_clients_get_epps_timeouts_and_one_quick_retry() -> None:
    redis = open_client("redis://127.0.0.1:1/0")
    assert isinstance(redis, Redis)
    options = redis.connection_pool.connection_kwargs
    assert options["socket_timeout"] == options["socket_connect_timeout"] == SOCKET_TIMEOUT
    assert options["retry"].get_retries() == 1
    await redis.aclose()


async def test_the_url_overrides_the_defaults() -> None:
    redis = open_client("redis://127.0.0.1:1/0?socket_timeout=5")
    assert isinstance(redis, Redis)
    assert redis.connection_pool.connection_kwargs["socket_timeout"] == 5
    await redis.aclose()


async def test_backoff_doubles_up_to_the_cap_with_jitter_and_resets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(client.asyncio, "sleep", sleep)
    backoff = Backoff(0.05)
    for _ in range(8):
        await backoff.failed()
    ceilings = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    assert all(c / 2 <= w <= c for w, c in zip(waits, ceilings, strict=True)), waits
    assert max(waits) <= MAX_BACKOFF
    backoff.reset(0.05)
    await backoff.failed()
    assert waits[-1] <= 0.1
