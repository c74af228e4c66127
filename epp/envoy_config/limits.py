"""The ``edge`` limits Envoy enforces on its own: circuit breakers on every cluster and the
overload manager that answers 503 before Envoy's heap runs out (docs/deploy.md, edge limits)."""

from __future__ import annotations

from typing import Any

from epp.edge import EdgeLimits
from epp.envoy_config.common import typed


def circuit_breakers(edge: EdgeLimits) -> dict[str, Any]:
    """Envoy's defaults (1024 requests, 3 concurrent retries per cluster) would turn a busy
    fleet into 503s: each in-flight LLM request holds one request on ``pool`` and one ext_proc
    stream on ``epp`` for its whole life (minutes for long generations), and epp's admission
    control is the throttle. The ``edge`` limits sit far above what a fleet serves and bound
    what a flood can make Envoy hold. A replica speaks HTTP/1.1: one connection per request."""
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": edge.max_requests,
                "max_pending_requests": edge.max_pending_requests,
                "max_requests": edge.max_requests,
                "max_retries": edge.max_retries,
            }
        ]
    }


def overload_manager(edge: EdgeLimits) -> dict[str, Any]:
    """Envoy sheds load before its heap runs out: past 90% of ``max_heap_bytes`` it returns
    free memory to the system, past 95% it answers new requests 503 (a JSON body, see
    :func:`local_replies`). Downstream connections are capped for the whole process."""
    heap = "envoy.resource_monitors.fixed_heap"
    connections = "envoy.resource_monitors.global_downstream_max_connections"
    return {
        "refresh_interval": "0.25s",
        "resource_monitors": [
            typed(
                heap,
                "envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                max_heap_size_bytes=edge.max_heap_bytes,
            ),
            typed(
                connections,
                "envoy.extensions.resource_monitors.downstream_connections.v3."
                "DownstreamConnectionsConfig",
                max_active_downstream_connections=edge.max_connections,
            ),
        ],
        "actions": [
            {
                "name": "envoy.overload_actions.shrink_heap",
                "triggers": [{"name": heap, "threshold": {"value": 0.9}}],
            },
            {
                "name": "envoy.overload_actions.stop_accepting_requests",
                "triggers": [{"name": heap, "threshold": {"value": 0.95}}],
            },
        ],
    }
