"""Python's cyclic garbage collector tuned for a serving process (called once it has started).

Measured under load (docs/overhead.md): with the interpreter's defaults an epp serving ~1,300
requests/s ran a full collection about every 4,000 requests, each walking every object the
process ever allocated (modules, configuration, gRPC, aiohttp: ~70,000 objects, plus the
prefix index) for 25-35 ms on one shared core, about 15 µs of CPU per request and a stall of
every stream in flight while it ran. What startup allocates lives as long as the process, so
:func:`gc.freeze` moves it out of the collector's sight, and a larger first-generation
threshold lets the short-lived objects of a request die by reference counting before a young
collection looks at them. Cycles are still collected: later, and over far fewer objects.
"""

from __future__ import annotations

import gc

# Allocations (net of deallocations) between young collections; the interpreter's default is
# 700. 5,000 measured ~4 µs of collection per request with pauses under 5 ms; 20,000 saved
# little more and paused up to 11 ms.
YOUNG_THRESHOLD = 5_000


def settle_heap() -> None:
    """Freeze what exists now (everything startup built) and raise the young threshold,
    keeping the interpreter's ratios between generations."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
