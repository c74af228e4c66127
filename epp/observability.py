"""epp's own Prometheus metrics and logging setup.

Metric names follow the ``epp_`` prefix; labels stay low-cardinality (pool, endpoint, model,
status) so a fleet of hundreds of endpoints does not blow up a dashboard.
"""

from __future__ import annotations

import logging
import sys

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "epp_requests_total",
    "Requests epp answered, by model and outcome (routed or the HTTP status it returned).",
    ["model", "outcome"],
)
PICKS = Counter(
    "epp_endpoint_picks_total",
    "Requests routed to each endpoint (first choice).",
    ["pool", "endpoint"],
)
DECISION_SECONDS = Histogram(
    "epp_decision_seconds",
    "Time from end of request body to the routing answer (parse, admission, scheduling).",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
)
IN_FLIGHT = Gauge(
    "epp_in_flight_requests",
    "ext_proc streams currently open.",
)
SCRAPES = Counter(
    "epp_scrapes_total",
    "vLLM /metrics scrapes by endpoint and result (ok, error, timeout).",
    ["endpoint", "result"],
)
ENDPOINT_READY = Gauge(
    "epp_endpoint_ready",
    "1 if the endpoint is eligible for routing, else 0.",
    ["pool", "endpoint"],
)
ENDPOINT_METRICS_AGE = Gauge(
    "epp_endpoint_metrics_age_seconds",
    "Seconds since the endpoint's last successful scrape, sampled when it was last scraped.",
    ["endpoint"],
)
STORE_UP = Gauge(
    "epp_state_store_up",
    "1 while the shared state store (Redis) is reachable; always 1 for the in-process store.",
)
SHARED_MEMBERS = Gauge(
    "epp_shared_members",
    "epp processes sharing state through Redis, this one included, as of the last sync.",
)
SHARED_LEASES = Gauge(
    "epp_shared_leases",
    "Endpoints this process scrapes for its group (all of them while Redis is unreachable).",
)
SHARED_INFLIGHT = Gauge(
    "epp_endpoint_inflight_requests",
    "Requests in flight per endpoint, routed by this process (origin=local) or by the other "
    "processes of its group (origin=remote), as of the last sync.",
    ["endpoint", "origin"],
)
SHARED_PICKS = Counter(
    "epp_shared_picks_total",
    "Prefix-index insertions and session bindings shipped to other epp processes (sent), "
    "applied from them (applied), unreadable (rejected) or dropped while Redis was "
    "unreachable for long (dropped).",
    ["direction"],
)
SHARED_PICK_DELAY = Histogram(
    "epp_shared_pick_delay_seconds",
    "From shipping in another epp process to application here (wall clocks).",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
CONFIG_RELOADS = Counter(
    "epp_config_reloads_total",
    "Configuration reload attempts by result (ok, rejected).",
    ["result"],
)


def setup_logging(level: str = "info") -> None:
    """Log one line per event to stderr; level names as in :mod:`logging`."""
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


# -- precise prefix cache (vLLM KV events) ---------------------------------------------------

KV_EVENT_BATCHES = Counter(
    "epp_kv_event_batches_total",
    "KV-event messages received from each endpoint's vLLM publisher.",
    ["endpoint"],
)
KV_INDEX_RESETS = Counter(
    "epp_kv_index_resets_total",
    "Times an endpoint's precise prefix entries were dropped, by reason: gap (lost messages), "
    "restart (sequence went back), malformed (undecodable message), cleared (AllBlocksCleared), "
    "overflow (more blocks than any cache holds: removes were lost).",
    ["endpoint", "reason"],
)
KV_UNKEYED_BLOCKS = Counter(
    "epp_kv_unkeyed_blocks_total",
    "Stored blocks skipped because their parent block was unknown (stored before epp "
    "subscribed, or lost in a gap).",
    ["endpoint"],
)
KV_INDEX_BLOCKS = Gauge(
    "epp_kv_index_blocks",
    "Distinct engine KV blocks in the precise prefix index, per endpoint.",
    ["endpoint"],
)
