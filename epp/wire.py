"""Names epp shares with Envoy, gateways and clients on the wire, declared once.

A header or metadata name spelled differently in two places is a routing bug that no unit test
of either place catches, so every module (the ext_proc answers, the client-header scrubbing, the
rendered Envoy configuration, the request policy's defaults) imports them from here. The
``x-gateway-*`` names and the ``envoy.lb`` namespaces are GIE's endpoint-picker protocol.
"""

from __future__ import annotations

# The picked endpoint, as a request header and as a key in the LB metadata namespace.
DESTINATION = "x-gateway-destination-endpoint"
# Dynamic metadata namespace Envoy's override-host policy reads the pick from.
LB_NAMESPACE = "envoy.lb"
# Metadata namespace and key through which a gateway narrows the candidates (GIE subset hint).
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
# Reported back by the gateway with the endpoint that actually served the request.
SERVED = "x-gateway-destination-endpoint-served"
# The overflow pool epp spills a request to; the route matching it picks that pool's cluster.
OVERFLOW = "x-epp-overflow"
# The prefill replica of a disaggregated request (``ip:port``), read by the decode replica's
# sidecar (llm-d's name), and the name GIE's proposal standardises (docs/pd.md).
PREFILL = "x-prefiller-host-port"
GATEWAY_PREFILL = "x-gateway-prefill-endpoints"
PREFILL_HEADERS = (PREFILL, GATEWAY_PREFILL)
# The data-parallel rank a request is for (epp.data_parallel): llm-d's ``host:port+rank``, or
# vLLM's own header with the rank's index.
DATA_PARALLEL_HOST_PORT = "x-data-parallel-host-port"
DATA_PARALLEL_RANK = "x-data-parallel-rank"
DATA_PARALLEL_HEADERS = (DATA_PARALLEL_HOST_PORT, DATA_PARALLEL_RANK)
# Headers that steer routing between gateway and epp: a client must never set them.
CONTROL_HEADERS = (
    DESTINATION,
    SUBSET_HINT_KEY,
    SERVED,
    OVERFLOW,
    *PREFILL_HEADERS,
    *DATA_PARALLEL_HEADERS,
)
# Metadata key carrying every candidate's scores when explaining; Envoy echoes it to the client.
SCORES = "x-epp-scores"
# A caller asking for the scores proves it may see them with this header (routing.explain_token);
# epp removes it before the request goes upstream.
EXPLAIN = "x-epp-explain"
# Clients send their own id to find their request in epp's logs.
REQUEST_ID = "x-request-id"

# Default request headers for sessions, priorities and objectives (configurable, see
# ``request:`` in the configuration); llm-d uses the same session header.
SESSION_HEADER = "x-session-token"
PRIORITY_HEADER = "x-priority"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
# A request's time-to-first-token target in milliseconds (llm-d's name), from trusted callers.
SLO_TTFT_HEADER = "x-llm-d-slo-ttft-ms"
SLO_TPOT_HEADER = "x-llm-d-slo-tpot-ms"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
# The flow of requests that name no fairness id (GIE's default).
DEFAULT_FLOW = "default-flow"
