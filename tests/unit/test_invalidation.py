"""The approximate index forgets endpoints that were removed or restarted."""

from __future__ import annotations

from epp.prefix.approximate import ApproximatePrefixIndex
from epp.prefix.invalidation import CacheInvalidator
from epp.state import EndpointMetrics, EndpointState, Snapshot


def snap(**queries: float) -> Snapshot:
    return Snapshot(
        {
            a.replace("_", "."): EndpointState(
                a.replace("_", "."), "p", True, EndpointMetrics(prefix_cache_queries=q), 1.0
            )
            for a, q in queries.items()
        }
    )


def test_restart_and_removal_forget_the_endpoint() -> None:
    # Two indexes (two hashing parameter sets in use): both forget.
    index, other = ApproximatePrefixIndex(), ApproximatePrefixIndex()
    for endpoint in ("a", "b", "c"):
        index.insert(endpoint, [1, 2, 3], capacity=100)
        other.insert(endpoint, [7], capacity=100)
    watcher = CacheInvalidator(lambda: [index, other])
    assert watcher.observe(snap(a=100, b=50, c=10), {"a", "b", "c"}) == []
    assert watcher.observe(snap(a=120, b=60, c=10), {"a", "b", "c"}) == []
    # b restarted (counter went down); c was removed from the configuration.
    assert sorted(watcher.observe(snap(a=130, b=5, c=10), {"a", "b"})) == ["b", "c"]
    assert index.size("a") == 3
    assert index.size("b") == 0
    assert index.size("c") == 0
    assert (other.size("a"), other.size("b"), other.size("c")) == (1, 0, 0)
