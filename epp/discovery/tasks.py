"""Stopping the per-pool follower tasks discovery runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence


async def cancel_all(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait until each has ended."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
