"""Immutable views of the fleet that scheduling reads without locks or I/O.

A background task builds a new :class:`Snapshot` whenever endpoint state changes and swaps it in
with one attribute assignment; a request that already holds the old snapshot keeps a consistent
view for its whole decision.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EndpointMetrics:
    """What one vLLM ``/metrics`` scrape says about a replica.

    Counters are kept raw (monotonic totals) so readers can compute rates between snapshots.
    """

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    max_loras: int = 0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    preemptions: float = 0.0

    @property
    def usable_kv_blocks(self) -> int | None:
        """KV blocks requests can use, the base of ``kv_usage`` (None until the cache geometry
        is scraped). vLLM keeps one of ``num_gpu_blocks`` as its null block."""
        if not self.block_size or not self.num_gpu_blocks:
            return None
        return self.num_gpu_blocks - 1


@dataclass(frozen=True, slots=True)
class EndpointState:
    """One replica as the picker sees it.

    ``ready`` is decided by the metric source (several failed scrapes in a row make an endpoint
    unready); ``scraped_at`` is wall-clock seconds of the last successful scrape so that processes
    sharing state through Redis agree on its age.
    """

    address: str
    pool: str
    ready: bool = False
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    scraped_at: float = 0.0
    failures: int = 0

    def age(self, now: float | None = None) -> float:
        """Seconds since the last successful scrape (``inf`` if never scraped)."""
        if self.scraped_at <= 0.0:
            return float("inf")
        return (time.time() if now is None else now) - self.scraped_at


@dataclass(frozen=True, slots=True)
class Snapshot:
    """All known endpoints, keyed by ``host:port``; never mutated after construction."""

    endpoints: Mapping[str, EndpointState] = field(default_factory=dict)
    version: int = 0

    def get(self, address: str) -> EndpointState | None:
        return self.endpoints.get(address)

    def ready_count(self) -> int:
        return sum(1 for e in self.endpoints.values() if e.ready)
