"""Forget approximate prefix state that no engine holds any more.

The approximate index only ever learns from epp's own picks, so it cannot see an engine lose its
cache. Two events say so anyway: an endpoint leaves the configuration, or an engine restarts,
which vLLM's monotonic ``prefix_cache_queries`` counter shows by going down. Without this, epp
would keep steering a prefix group to a replica whose cache is empty.

The fleet state holds the prefix indexes, so :mod:`epp.state` depends on this package; what this
module reads of a snapshot is declared as protocols here instead of importing it back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Protocol

from epp.prefix.approximate import ApproximatePrefixIndex

log = logging.getLogger("epp.prefix")


class _Counters(Protocol):
    @property
    def prefix_cache_queries(self) -> float: ...


class _Endpoint(Protocol):
    @property
    def scraped_at(self) -> float: ...
    @property
    def metrics(self) -> _Counters: ...


class Observed(Protocol):
    """What :meth:`CacheInvalidator.observe` reads: an :class:`epp.state.snapshot.Snapshot`."""

    @property
    def endpoints(self) -> Mapping[str, _Endpoint]: ...


class CacheInvalidator:
    """``indexes``: the approximate indexes in use now (one per hashing parameter set)."""

    def __init__(self, indexes: Callable[[], Iterable[ApproximatePrefixIndex]]) -> None:
        self._indexes = indexes
        self._queries: dict[str, float] = {}

    def observe(self, snapshot: Observed, configured: Collection[str]) -> list[str]:
        """Compare with the last observation; forget removed or restarted endpoints."""
        forgotten = [a for a in self._queries if a not in configured]
        for address in forgotten:
            del self._queries[address]
        for address, state in snapshot.endpoints.items():
            if address not in configured or state.scraped_at <= 0:
                continue
            queries = state.metrics.prefix_cache_queries
            last = self._queries.get(address)
            if last is not None and queries < last:
                log.info("endpoint %s restarted (prefix cache counters reset)", address)
                forgotten.append(address)
            self._queries[address] = queries
        for index in self._indexes():
            for address in forgotten:
                index.forget(address)
        return forgotten
