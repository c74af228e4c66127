"""Python's cyclic garbage collector tuned for a serving process (called once it has started).

With the interpreter's defaults a busy epp runs a full collection every few thousand requests,
each walking every object the process ever allocated (modules, configuration, gRPC, aiohttp,
the prefix index) while every stream in flight waits. What
startup allocates lives as long as the process, so :func:`gc.freeze` moves it out of the
collector's sight, and a larger young-generation threshold lets a request's short-lived
objects die by reference counting before a young collection looks at them. Cycles are still
collected: later, and over far fewer objects.
"""

from __future__ import annotations

import gc

# Allocations (net of deallocations) between young collections; the interpreter's default is
# 700. A trade between the collector's CPU per request and its longest pause.
YOUNG_THRESHOLD = 5_000


def settle_heap() -> None:
    """Freeze what exists now (everything startup built) and raise the young threshold,
    keeping the interpreter's ratios between generations."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
