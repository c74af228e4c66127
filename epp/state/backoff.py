"""Capped, jittered exponential backoff for the loops that talk to Redis.

Every loop that shares state through Redis (the endpoint store, the shared-state tick, the
picks stream, tenant budgets) survives a failed round trip the same way: it waits twice as long
as the last time, up to a second (so a Redis that comes back is used within a second), with
jitter (so the epps of a group that lost Redis together do not return in the same instant), and
after a success starts again from its own interval.
"""

from __future__ import annotations

import asyncio
import random

MAX_SECONDS = 1.0


class Backoff:
    __slots__ = ("_delay",)

    def __init__(self, base: float) -> None:
        self._delay = base

    def reset(self, base: float) -> None:
        """The loop's round trip succeeded: the next failure waits about twice ``base``."""
        self._delay = base

    async def failed(self) -> None:
        """Wait before the next try after a failure."""
        self._delay = min(self._delay * 2, MAX_SECONDS)
        await asyncio.sleep(self._delay * random.uniform(0.5, 1.0))
