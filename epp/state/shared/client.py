"""The one Redis connection layer: how epp opens a client and how its loops survive failures.

Every loop that shares state through Redis (the endpoint store, the shared-state tick, the picks
stream, tenant budgets) opens its client with :func:`open_client` and waits out failures with
:class:`Backoff`, so a hung or lost Redis costs each of them the same bounded time and they come
back together:

- a command gives up after :data:`SOCKET_TIMEOUT` (a hung Redis must not stall a loop), and is
  retried once at once (a pooled connection the server closed); any longer wait is the loop's
  own backoff, which keeps its state (up or down, what it logged) in one place;
- after a failed round trip a loop waits twice as long as the last time, up to
  :data:`MAX_BACKOFF` (a Redis that comes back is used within a second), with jitter (the epps
  of a group that lost Redis together do not return in the same instant); after a success it
  starts again from its own interval.

The URL names the deployment (standalone, Sentinel or Cluster, see
:mod:`epp.state.shared.connect`); its query options win over these defaults.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from epp.state.shared.connect import Client, connect

SOCKET_TIMEOUT = 1.0
MAX_BACKOFF = 1.0


def open_client(url: str, **options: Any) -> Client:
    """A client for ``url`` with epp's timeouts and retry; ``options`` override them.

    Nothing connects until the first command; a malformed URL raises ValueError at once.
    """
    defaults: dict[str, Any] = {
        "socket_timeout": SOCKET_TIMEOUT,
        "socket_connect_timeout": SOCKET_TIMEOUT,
        "retry": Retry(NoBackoff(), 1),
    }
    return connect(url, **{**defaults, **options})


class Backoff:
    """Capped, jittered exponential backoff of one loop."""

    __slots__ = ("_delay",)

    def __init__(self, base: float) -> None:
        self._delay = base

    def reset(self, base: float) -> None:
        """The loop's round trip succeeded: the next failure waits about twice ``base``."""
        self._delay = base

    async def failed(self) -> None:
        """Wait before the next try after a failure."""
        self._delay = min(self._delay * 2, MAX_BACKOFF)
        await asyncio.sleep(self._delay * random.uniform(0.5, 1.0))
