"""epp's own Prometheus metrics and logging setup.

Metric names follow the ``epp_`` prefix; labels stay low-cardinality (pool, endpoint, model,
status) so a fleet of hundreds of endpoints does not blow up a dashboard.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TypeVar, cast

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from epp import __version__
from epp.tallied import TalliedCounter, TalliedHistogram

M = TypeVar("M", bound=MetricWrapperBase)


def child(metric: M, *values: str) -> M:
    """``metric.labels(*values)``, read straight from the metric's series when it exists:
    ``labels`` validates, converts and takes a lock every call (paid about ten times a
    request); a dict read suffices once the series is there. A removed series is absent, so
    ``labels`` re-creates it as it always did. (``_metrics`` is prometheus_client's own
    table of label values to series; tests/unit/test_observability_child.py pins it.)"""
    # The type as a string: ``cast(M | None, ...)`` would build the union on every call.
    found = cast("M | None", metric._metrics.get(values))
    return metric.labels(*values) if found is None else found


REQUESTS = TalliedCounter(
    "epp_requests_total",
    "Requests epp answered, by model and outcome (routed or the HTTP status it returned).",
    ["model", "outcome"],
)
PICKS = TalliedCounter(
    "epp_endpoint_picks_total",
    "Requests routed to each endpoint (first choice).",
    ["pool", "endpoint"],
)
DISAGG_DECISIONS = TalliedCounter(
    "llm_d_inference_scheduler_disagg_decision_total",
    "Requests of a profile with a prefill/decode decider, by decision: decode-only (the decode "
    "replica prefills) or prefill-decode (a prefill replica does; llm-d's name, docs/pd.md).",
    ["decision_type"],
)
DECISION_SECONDS = TalliedHistogram(
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
    "Prefix-index insertions, session bindings and health verdicts shipped to other epp "
    "processes (sent), applied from them (applied), unreadable (rejected) or dropped while "
    "Redis was unreachable for long (dropped).",
    ["direction"],
)
SHARED_REJECTED = Counter(
    "epp_shared_state_rejected_total",
    "Entries read from Redis and ignored (reason=malformed: unreadable or of the wrong types; "
    "version: a schema version this release does not read), and timestamps clamped because "
    "they lay in the future (reason=future), per payload kind.",
    ["kind", "reason"],
)
SHARED_PICKS_PENDING = Gauge(
    "epp_shared_picks_pending",
    "Prefix-index insertions, session bindings and health verdicts made here and not yet in "
    "Redis: a few between two shipments, growing while Redis is unreachable.",
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
CONFIG_RESTART_REQUIRED = Counter(
    "epp_config_restart_required_total",
    "Reloaded configuration changes not applied because their section needs a restart.",
    ["section"],
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
    "overflow (more blocks than any cache holds: removes were lost), rank (a batch of another "
    "data-parallel rank).",
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


# -- responses (epp/extproc/response_stream.py) ----------------------------------------------
# Names GIE and llm-d users already query keep their names and labels (model_name: what the
# client asked for, target_model_name: the model a rewrite sent it to, else the same; both
# bounded by the configuration, epp.rewrite); epp-only ones are prefixed epp_.

_MODEL = ["model_name", "target_model_name"]
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)
_PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)

OBJECTIVE_REQUESTS = TalliedCounter(
    "inference_objective_request_total", "Requests epp routed, per model.", _MODEL
)
OBJECTIVE_ERRORS = TalliedCounter(
    "inference_objective_request_error_total",
    "Routed requests whose response failed: the upstream status (e.g. 500) or 'incomplete' "
    "(the stream closed before the response ended).",
    [*_MODEL, "error_code"],
)
REQUEST_DURATION = TalliedHistogram(
    "inference_objective_request_duration_seconds",
    "From the request's arrival at epp to the end of its response, seen at the gateway.",
    _MODEL,
    buckets=_LATENCY_BUCKETS,
)
NORMALIZED_TPOT = TalliedHistogram(
    "inference_objective_normalized_time_per_output_token_seconds",
    "Request duration divided by its output tokens (responses that reported usage).",
    _MODEL,
    buckets=_PER_TOKEN_BUCKETS,
)
INPUT_TOKENS = TalliedHistogram(
    "inference_objective_input_tokens",
    "Prompt tokens per request (reported usage).",
    _MODEL,
    buckets=_TOKEN_BUCKETS,
)
OUTPUT_TOKENS = TalliedHistogram(
    "inference_objective_output_tokens",
    "Output tokens per request (reported usage).",
    _MODEL,
    buckets=_TOKEN_BUCKETS,
)
CACHED_TOKENS = TalliedHistogram(
    "llm_d_epp_request_cached_tokens",
    "Prompt tokens served from the prefix cache per request (when the engine reports them).",
    _MODEL,
    buckets=_TOKEN_BUCKETS,
)
TTFT = TalliedHistogram(
    "llm_d_epp_request_ttft_seconds",
    "Time to first token of streamed responses, from the request's arrival at epp to the "
    "first SSE event carrying output.",
    _MODEL,
    buckets=_LATENCY_BUCKETS,
)
ITL = TalliedHistogram(
    "llm_d_epp_request_streaming_itl_seconds",
    "Gaps between consecutive SSE events carrying output (one event may carry several tokens).",
    _MODEL,
    buckets=_PER_TOKEN_BUCKETS,
)
TPOT = TalliedHistogram(
    "epp_request_tpot_seconds",
    "Time per output token of streamed responses: first to last token event over "
    "completion_tokens - 1.",
    _MODEL,
    buckets=_PER_TOKEN_BUCKETS,
)
TOKENS = TalliedCounter(
    "epp_tokens_total",
    "Tokens of finished responses by model, objective (configured names only) and kind "
    "(prompt, completion, cached).",
    ["model", "objective", "kind"],
)
RESPONSES = TalliedCounter(
    "epp_endpoint_responses_total",
    "Upstream responses per endpoint that served them (after retries) and status class.",
    ["endpoint", "code"],
)
RESPONSE_CODES = ("1xx", "2xx", "3xx", "4xx", "5xx", "other")


def response_code(status: int) -> str:
    """The ``code`` label of :data:`RESPONSES`: the status class, bounded to six values."""
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


def forget_endpoint_responses(endpoint: str) -> None:
    """Drop an endpoint's response series when it leaves, so label sets stay bounded."""
    for code in RESPONSE_CODES:
        RESPONSES.remove(endpoint, code)  # absent label sets are ignored


MOVED = Counter(
    "epp_requests_moved_total",
    "Requests a retry moved off the picked endpoint, with their accounting (in flight, "
    "prefix index, session).",
)


EJECTED = Gauge(
    "epp_endpoint_ejected",
    "1 while passive health keeps the endpoint out of scheduling (open or half-open circuit).",
    ["pool", "endpoint"],
)
EJECTIONS = Counter(
    "epp_endpoint_ejections_total",
    "Ejections passive health decided in this process, by reason (consecutive, error-rate, "
    "latency, probation: a failure soon after a readmission, trial-<failure>: a failed "
    "half-open trial).",
    ["pool", "endpoint", "reason"],
)
EJECTION_REASONS = (
    "consecutive",
    "error-rate",
    "latency",
    "probation",
    "trial-5xx",
    "trial-retried",
    "trial-latency",
)


def set_ejected(pool: str, endpoint: str, ejected: bool) -> None:
    EJECTED.labels(pool, endpoint).set(1 if ejected else 0)


def forget_endpoint_health(pool: str, endpoint: str) -> None:
    """Drop an endpoint's health series when it leaves, so label sets stay bounded."""
    EJECTED.remove(pool, endpoint)  # absent label sets are ignored
    for reason in EJECTION_REASONS:
        EJECTIONS.remove(pool, endpoint, reason)


# -- request results, scheduler latency, build info (docs/metrics.md) -------------------------

RESULTS = TalliedCounter(
    "epp_request_results_total",
    "Every request epp saw, by how it ended: ok, a refusal epp answered itself (bad_request, "
    "model_not_found, too_large, rate_limited, no_endpoint, overloaded, refused_other) or a routed "
    "request's failed response (upstream_4xx, upstream_5xx, incomplete).",
    ["reason"],
)
# epp's own refusals by HTTP status; anything else is refused_other (bounded label values).
REFUSAL_REASONS = {
    400: "bad_request",
    404: "model_not_found",
    413: "too_large",
    429: "rate_limited",
    503: "no_endpoint",
}
# Refusals told apart by their error code rather than their status.
REFUSAL_CODES = {"buffer_full": "overloaded"}


def refusal_reason(status: int, code: str | None = None) -> str:
    """The :data:`RESULTS` reason of a request epp refused with ``status`` (and ``code``)."""
    by_code = REFUSAL_CODES.get(code or "")
    return by_code or REFUSAL_REASONS.get(status, "refused_other")


BUFFERED_BYTES = Gauge(
    "epp_buffered_request_bytes",
    "Request-body bytes this process holds (received, routing answer not yet sent), against "
    "server.max_buffered_bytes.",
)


LATENCY_TARGETS = TalliedCounter(
    "epp_latency_target_requests_total",
    "Requests with a latency target (x-llm-d-slo-ttft-ms / -tpot-ms, the objective's or the "
    "latency-target-filter's), per objective and target (ttft, tpot), by whether the measured "
    "latency met it; refused ones count as refused (docs/learned-latency.md).",
    ["objective", "target", "result"],
)

INFO = Gauge(
    "inference_extension_info",
    "Always 1; its labels name the running build (GIE's name, for dashboards that read it).",
    ["commit", "build_ref"],
)
# The commit comes from the build (the Dockerfile can pass EPP_COMMIT); a source checkout says so.
INFO.labels(os.environ.get("EPP_COMMIT", "unknown"), __version__).set(1)
# -- flow control (epp/admission/controller.py), GIE's names ---------------------------------
FLOW_QUEUE_SIZE = Gauge(
    "inference_extension_flow_control_queue_size",
    "Requests held by flow control, per pool (model), priority and fairness id.",
    ["inference_pool", "priority", "fairness_id"],
)
FLOW_QUEUE_DURATION = Histogram(
    "inference_extension_flow_control_request_queue_duration_seconds",
    "Time requests spent held by flow control, by outcome (dispatched, rejected, cancelled).",
    ["inference_pool", "priority", "outcome"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
FLOW_DROPPED = Counter(
    "epp_flow_control_requests_dropped_total",
    "Requests flow control refused, per pool (model) and llm-d's drop reason (the "
    "x-epp-request-dropped-reason header): queue full, wait over the TTL, displaced.",
    ["inference_pool", "reason"],
)
SPILLED = Counter(
    "epp_spilled_requests_total",
    "Requests sent to an overflow pool because their home pool was saturated (spillover).",
    ["model", "overflow"],
)
# -- tenant budgets (epp/admission/budgets.py) ---------------------------------------------
BUDGET_ADMITTED = Counter(
    "epp_budget_admitted_total",
    "Requests admitted by tenant budgets, per tenant (a configured name, else 'default').",
    ["tenant"],
)
BUDGET_REFUSED = Counter(
    "epp_budget_refused_total",
    "Requests refused with 429 by tenant budgets, per tenant and the budget that ran out "
    "(kind: requests or tokens).",
    ["tenant", "kind"],
)
BUDGET_REMAINING = Gauge(
    "epp_budget_remaining",
    "What the tenant may still spend in its window (requests or tokens) as this process "
    "saw it at its last decision or sync.",
    ["tenant", "kind"],
)
BUDGET_MEMBERS = Gauge(
    "epp_budget_members",
    "epp processes the budget group counted at this process's last sync with Redis; in local "
    "mode each tenant is limited to limit / this many here.",
)
BUDGET_LOCAL_MODE = Gauge(
    "epp_budget_local_mode",
    "1 while Redis is unreachable and this process enforces budgets alone (each tenant "
    "limited to limit / processes here), else 0.",
)
POOL_SATURATION = Gauge(
    "inference_extension_flow_control_pool_saturation",
    "1 when every candidate endpoint of the pool (model) was full at the last check, else 0.",
    ["inference_pool"],
)
FLOW_GROUP = Gauge(
    "epp_flow_control_group",
    "1 while this process exchanges flow-control queues with the other epp processes "
    "through Redis (dispatch then follows the group's order, unless admission.scope is "
    "local); 0 while it orders only its own queue (no Redis, or Redis down).",
)
FLOW_YIELDS = Counter(
    "epp_flow_control_yields_total",
    "Times this process left a freed slot to work waiting in another epp process (a higher "
    "priority band, or a fairness id the group has served less), per pool (model).",
    ["inference_pool"],
)
