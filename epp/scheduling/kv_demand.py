"""How much of an endpoint's KV cache is taken, as the scorers that weigh memory see it.

Shared by ``kv-pressure-scorer`` (demand as a fraction of the cache) and ``ttft-scorer`` (the
tokens beyond it), so both project demand the same way. Both add the request's own uncached
prompt and requested output to what is held: vLLM admits a request when its prompt fits, but
the output needs blocks as it grows. The result is a plain tuple because ``ttft-scorer`` calls
this for every candidate of every request (decision time, docs/scheduling.md).
"""

from __future__ import annotations

from epp.scheduling.framework import Cycle
from epp.state.snapshot import EndpointState


def kv_held(endpoint: EndpointState, cycle: Cycle) -> tuple[float, int] | None:
    """``(tokens held, tokens the cache holds)``, or None while the cache geometry is unknown.

    What the endpoint holds is the larger of two views: the tokens epp has in flight there
    (uncached prompt plus requested output; it sees its own picks at once, before any scrape)
    and the scraped KV usage (which sees other gateways' work and shared prefix blocks).
    """
    metrics = endpoint.metrics
    usable = metrics.usable_kv_blocks
    if usable is None or metrics.block_size is None:
        return None
    capacity = usable * metrics.block_size
    in_flight = cycle.fleet.inflight.load(endpoint.address).tokens
    return max(in_flight, metrics.kv_usage * capacity), capacity
