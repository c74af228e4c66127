"""Render the Envoy 1.40 bootstrap that fronts a vLLM fleet with epp as its endpoint picker.

``epp envoy-config --config epp.yaml`` prints it; :func:`render` is the library entry point.
Every choice below was checked against the real Envoy 1.40 binary (``tests/unit/
test_envoy_config.py`` runs traffic through it); ``envoy/README.md`` explains them for operators.

The pieces, in request order:

* **the listener** normalises the path (RFC 3986 dot segments, merged slashes; an escaped
  slash is refused) before any filter runs, so epp and the replica see the same path and epp
  matches the API on it exactly. Limits from the ``edge`` section: per-connection buffers,
  request, header and idle timeouts, circuit breakers on every cluster, and an overload
  manager that answers 503 before Envoy's heap runs out (docs/deploy.md, edge limits).
* **header_mutation before ext_proc** strips the control headers a client could send
  (``x-gateway-destination-endpoint`` and friends), so epp never sees a forged answer and the
  upstream never receives one, and every identity and latency-target header (priority,
  objective, fairness id, ``x-llm-d-slo-*``) unless ``request.trusted_headers`` says a gateway
  in front sets them.
* **jwt_authn / ext_authz** (``request.jwt`` / ``request.auth_service``), when configured,
  authenticate the request and set the identity headers from the token's claims or the
  service's answer: after the strip, so only their values reach epp (docs/identity.md).
* **ext_proc** streams the request to epp (cluster ``epp``), and the response back to it (see
  :func:`_processing_mode`). Requests never reach a replica epp did not choose: epp's answer
  comes back as ``envoy.lb`` dynamic metadata (applied only because the namespace is listed in
  ``metadata_options.receiving_namespaces``) and without it the pool's balancer returns no host
  (503). On top of that, full-duplex mode fails closed (``failure_mode_allow: false``: 500/504
  when epp is unreachable or silent). Buffered mode sets ``failure_mode_allow: true`` so that an
  epp dying while a response streams does not cut the response (measured: with ``false`` the
  client's stream is reset, with ``true`` it completes; docs/response-path.md); a request epp
  never answered still fails, with 503 from the pool. The stream stays open until the response
  is complete (``response_trailer_mode: SEND``).
* **route ``/``** has no timeout (``timeout: 0s``: a generation may run for minutes) and an
  idle timeout of ``edge.stream_idle_timeout_s`` (long: silent when not streamed), and a retry
  policy with ``num_retries =
  routing.fallbacks``, so a replica that answers 5xx, resets or cannot be reached makes Envoy
  try the next entry of epp's list (only before the response has begun). It also adds
  ``x-gateway-destination-endpoint-served: %UPSTREAM_HOST%`` to the response for epp, which
  the header_mutation filter strips before the client sees it.
* **ext_proc on the response**: headers and the streamed body go to epp on the same stream
  (status, served endpoint, token timings, usage; docs/response-path.md). Envoy's own replies
  skip it (a matcher on the served-endpoint header), so they are written at once.
* **cluster ``pool``** is a STATIC cluster holding every endpoint of every pool, balanced by the
  ``override_host`` policy that reads ONLY the metadata (never the header: metadata cannot be
  set by a client). Each attempt (first try, then each retry) consumes the next address of the
  comma list. When the list is absent or used up, the fallback policy is a subset balancer with
  no subsets and ``NO_FALLBACK``: it never returns a host, so Envoy answers 503 "no healthy
  upstream" instead of silently picking a random replica.
* **clusters ``overflow-NAME``** (spillover, docs/admission.md): each overflow pool's gateway,
  reached by a route ahead of the pool's that matches the ``x-epp-overflow`` header epp sets
  on a spilled request (client copies are stripped by the header_mutation filter).
* **cluster ``epp``** holds one or more epp processes (active-active) over HTTP/2. A stream
  that cannot reach an epp is retried on another (``grpc_service.retry_policy``); gRPC health
  checks on each epp's health port and outlier detection take a dead or draining epp out of
  rotation. Measured: hard-killing one of two epps under load failed only the requests whose
  streams were open on it (tests/e2e/test_active_active.py). With :class:`EppTls` it is
  reached over TLS (mutual with a client certificate), health checks included
  (tests/e2e/test_tls.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from epp.admission.spillover import OverflowPool
from epp.config import Config, ConfigError, load_config
from epp.discovery.eds import EdsFile, eds_path
from epp.discovery.spec import DnsSpec, KubernetesSpec
from epp.edge import AuthService, EdgeLimits, JwtAuth
from epp.wire import (
    CONTROL_HEADERS,
    DESTINATION,
    LB_NAMESPACE,
    OVERFLOW,
    SCORES,
    SERVED,
    SUBSET_HINT_NAMESPACE,
)

Mode = Literal["buffered", "full-duplex"]
MODES: tuple[Mode, ...] = ("buffered", "full-duplex")

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
POOL_CLUSTER = "pool"
EPP_CLUSTER = "epp"

_TYPE = "@type"
_T = "type.googleapis.com/"


@dataclass(frozen=True, slots=True)
class EppTls:
    """How Envoy reaches epp over TLS (``epp serve`` with ``server.tls``): trust ``ca``, accept
    only a certificate naming ``san`` (also sent as SNI), and present ``cert``/``key`` when epp
    requires client certificates (``server.tls.client_ca``)."""

    ca: str
    san: str
    cert: str | None = None
    key: str | None = None


def _upstream_tls(tls: EppTls) -> dict[str, Any]:
    """The epp cluster's transport socket. Envoy's health checks use the cluster's transport
    socket too, so the gRPC health checks are encrypted and verified the same way."""
    san_type = "IP_ADDRESS" if _is_ip(tls.san) else "DNS"
    common: dict[str, Any] = {
        "alpn_protocols": ["h2"],
        "validation_context": {
            "trusted_ca": {"filename": tls.ca},
            "match_typed_subject_alt_names": [
                {"san_type": san_type, "matcher": {"exact": tls.san}}
            ],
        },
    }
    if tls.cert is not None and tls.key is not None:
        common["tls_certificates"] = [
            {"certificate_chain": {"filename": tls.cert}, "private_key": {"filename": tls.key}}
        ]
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            _TYPE: _T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": tls.san,
            "common_tls_context": common,
        },
    }


def parse_address(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host without brackets, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _socket(value: str) -> dict[str, Any]:
    host, port = parse_address(value)
    return {"socket_address": {"address": host, "port_value": port}}


def _duration(ms: int) -> str:
    return f"{ms / 1000:g}s"


def _typed(name: str, type_name: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "typed_config": {_TYPE: _T + type_name, **config}}


def _policy(name: str, type_name: str, **config: Any) -> dict[str, Any]:
    """A ``LoadBalancingPolicy`` with a single typed extension."""
    return {"policies": [{"typed_extension_config": _typed(name, type_name, **config)}]}


def _circuit_breakers(edge: EdgeLimits) -> dict[str, Any]:
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


def _http_options(**explicit: Any) -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            _TYPE: _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": explicit,
        }
    }


def _processing_mode(mode: Mode) -> dict[str, str]:
    """Request headers and body go to epp; so do the response's headers and streamed body.

    Response body: STREAMED after a buffered request (Envoy sends each chunk and forwards it
    once epp answers, which epp does at once, unchanged unless it strips an injected usage
    chunk), FULL_DUPLEX_STREAMED after a full-duplex one (Envoy forwards what epp echoes).
    Neither buffers the response, so server-sent events reach the client as they are
    produced; docs/response-path.md has the measurements.

    ``response_trailer_mode: SEND`` is there for the stream's lifetime, not for trailers (vLLM
    over HTTP/1.1 sends none, so no message results): with it the stream stays open until the
    response completes (or the client goes away), so epp counts a request as in flight for
    exactly as long as it is. An upstream that does send trailers costs one
    ``response_trailers`` message, which epp answers.

    Full-duplex requires both trailer modes SEND (Envoy rejects the config otherwise; the rule
    is per direction: SEND trailers wherever a body is FULL_DUPLEX_STREAMED).
    """
    buffered = mode == "buffered"
    return {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "BUFFERED" if buffered else "FULL_DUPLEX_STREAMED",
        "response_body_mode": "STREAMED" if buffered else "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SKIP" if buffered else "SEND",
        "response_trailer_mode": "SEND",
    }


# Envoy's message timeout outlasts a held request's TTL by this much, so epp's own 503 (with
# Retry-After and the reason) reaches the client rather than Envoy's timeout.
QUEUE_TIMEOUT_MARGIN_MS = 2000


def _fit_queue(config: Config, message_timeout_ms: int) -> int:
    """The message timeout, raised above the flow-control queue's longest TTL when epp may hold
    requests (buffered mode: the held body answer is one message). An epp that stops answering
    still has its held requests released by Envoy, at TTL + margin instead of never."""
    if config.flow_control.mode != "queue":
        return message_timeout_ms
    ttl_ms = int(config.flow_control.limits.longest_ttl * 1000)
    return max(message_timeout_ms, ttl_ms + QUEUE_TIMEOUT_MARGIN_MS)


def _ext_proc_filter(mode: Mode, message_timeout_ms: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        # No grpc_service.timeout: it would be a deadline on the whole stream, which lives as
        # long as the HTTP request.
        "grpc_service": {
            "envoy_grpc": {"cluster_name": EPP_CLUSTER},
            # A stream that cannot reach an epp (dead process, refused, reset or UNAVAILABLE
            # before epp's first answer) is replayed on another epp instead of failing the
            # request with a 500. Retries here can land on the dead epp again (measured:
            # previous_hosts does not keep them off it; measured before the epp cluster's
            # merge window was set to 0, see there), so they must outlast the health checks
            # that remove it: 10 retries backing off 25 -> 250 ms span ~1-2 s. Measured
            # (SIGKILL of one of two epps, sequential requests right after the stack started,
            # benchmarks/failover.py and docs/active-active.md): with 4 retries 3 of 5 runs
            # failed 3 requests started after the kill (retry limit exceeded, every attempt on
            # the dead epp), with 10 none of 5 did; with 2 retries over 10-50 ms and no "reset",
            # up to 200 requests per kill failed under 8 clients.
            "retry_policy": {
                "retry_on": "connect-failure,refused-stream,unavailable,reset",
                "num_retries": 10,
                "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.25s"},
                "retry_host_predicate": [
                    _typed(
                        "envoy.retry_host_predicates.previous_hosts",
                        "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate",
                    )
                ],
                "host_selection_retry_max_attempts": 3,
            },
        },
        # Buffered: a late failure of epp (a crash while the response streams) must not cut the
        # response; the pool still refuses requests epp did not place (see module docstring).
        # Full duplex holds the body in epp's hands, so Envoy cannot go on without it: Envoy
        # 1.40 fails a FULL_DUPLEX_STREAMED request whose processor dies or cannot be reached
        # even with failure_mode_allow: true (measured: 500 for an unreachable epp, the client
        # stream reset for one that dies mid-response; benchmarks/failover.py).
        "failure_mode_allow": mode == "buffered",
        # Per message (buffered: the body answer includes scheduling time). Full-duplex bodies
        # are not covered by it (Envoy 1.40).
        "message_timeout": _duration(message_timeout_ms),
        "processing_mode": _processing_mode(mode),
        "metadata_options": {
            # Without this Envoy silently drops epp's envoy.lb metadata and nothing routes.
            "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
            # Lets a filter in front of ext_proc narrow the candidates (GIE subset hint).
            "forwarding_namespaces": {"untyped": [SUBSET_HINT_NAMESPACE]},
        },
    }
    if mode == "full-duplex":
        # Envoy strips Content-Length when a processor streams the body back; epp echoes the
        # body unchanged and re-sends Content-Length, so let it through (vLLM then gets a
        # plain body instead of chunked encoding).
        config["allow_content_length_header"] = True
    processor = _typed(
        "envoy.filters.http.ext_proc",
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        **config,
    )
    # Envoy's own replies (its HTTP codec refusing malformed requests, the buffer limit's 413)
    # skip ext_proc on the way out. Processing them gained nothing, and while ext_proc held
    # their headers for epp the codec closed the connection, so the client got no response at
    # all (docs/hostile-input.md). Upstream responses always carry the served-endpoint header
    # the route adds; local replies never do, so epp still sees every upstream response.
    return _typed(
        "envoy.filters.http.ext_proc",
        "envoy.extensions.common.matching.v3.ExtensionWithMatcher",
        extension_config=processor,
        xds_matcher={
            "matcher_list": {
                "matchers": [
                    {
                        "predicate": {"not_matcher": _has_header(SERVED)},
                        "on_match": {
                            "action": _typed(
                                "skip-local-replies",
                                "envoy.extensions.filters.common.matcher.action.v3.SkipFilter",
                            )
                        },
                    }
                ]
            }
        },
    )


def _has_header(name: str) -> dict[str, Any]:
    """A matcher predicate: the response carries header ``name`` (any value)."""
    return {
        "single_predicate": {
            "input": _typed(
                "response-header",
                "envoy.type.matcher.v3.HttpResponseHeaderMatchInput",
                header_name=name,
            ),
            "value_match": {"safe_regex": {"regex": ".*", "google_re2": {}}},
        }
    }


def ext_proc_settings(boot: dict[str, Any]) -> list[dict[str, Any]]:
    """The ext_proc filters' own settings (``ExternalProcessor``, inside their matcher wrapper)
    in a rendered bootstrap, one per listener that has one, for tools and tests that read or
    adjust them in place."""
    return [
        http["typed_config"]["extension_config"]["typed_config"]
        for listener in boot["static_resources"]["listeners"]
        for chain in listener["filter_chains"]
        for network in chain["filters"]
        for http in network["typed_config"].get("http_filters", [])
        if http["name"] == "envoy.filters.http.ext_proc"
    ]


def _header_mutation_filter(config: Config) -> dict[str, Any]:
    # First in the chain, so last on the response: the served-endpoint header the route adds
    # for epp is gone before the client sees it, even when epp did not process the response.
    policy = config.request
    # Identity headers from clients never reach epp or the pool, unless a gateway in front of
    # this Envoy sets them (request.trusted_headers); jwt_authn / ext_authz set them later.
    identity = () if policy.trusted_headers else policy.identity_headers()
    return _typed(
        "envoy.filters.http.header_mutation",
        "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        mutations={
            "request_mutations": [{"remove": h} for h in (*CONTROL_HEADERS, *identity)],
            "response_mutations": [{"remove": SERVED}],
        },
    )


JWT_PROVIDER = "epp"
AUTH_CLUSTER = "auth"


def _authentication_filters(config: Config) -> list[dict[str, Any]]:
    """The filters that authenticate a request and set its identity headers, after the
    header_mutation filter stripped the client's copies and before ext_proc reads them."""
    auth = config.authentication
    out = []
    if auth.jwt is not None:
        out.append(_jwt_filter(auth.jwt, config))
    if auth.service is not None:
        out.append(_ext_authz_filter(auth.service))
    return out


def _jwt_filter(jwt: JwtAuth, config: Config) -> dict[str, Any]:
    """Envoy verifies the bearer token (signature against the local JWKS, issuer, audience,
    expiry) and copies the tenant and objective claims into epp's headers. A token that fails
    is refused with 401 whatever ``required`` says; only a request with none may pass, with
    the default identity. The token is not forwarded: replicas have no use for it."""
    policy = config.request
    provider: dict[str, Any] = {
        "issuer": jwt.issuer,
        "local_jwks": {"filename": jwt.jwks_file},
        "from_headers": [{"name": "authorization", "value_prefix": "Bearer "}],
        "forward": False,
        "claim_to_headers": [
            {"header_name": policy.fairness_header, "claim_name": jwt.tenant_claim},
            {"header_name": policy.objective_header, "claim_name": jwt.objective_claim},
        ],
    }
    if jwt.audiences:
        provider["audiences"] = list(jwt.audiences)
    requires: dict[str, Any] = {"provider_name": JWT_PROVIDER}
    if not jwt.required:
        requires = {"requires_any": {"requirements": [requires, {"allow_missing": {}}]}}
    return _typed(
        "envoy.filters.http.jwt_authn",
        "envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
        providers={JWT_PROVIDER: provider},
        rules=[{"match": {"prefix": "/"}, "requires": requires}],
    )


def _ext_authz_filter(service: AuthService) -> dict[str, Any]:
    """Envoy asks the authorization service about each request (its headers, not its body);
    a 2xx answer's identity headers are set on the request, any other answer goes back to the
    client, and a service that cannot be reached refuses the request (403)."""
    return _typed(
        "envoy.filters.http.ext_authz",
        "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
        http_service={
            "server_uri": {
                "uri": f"http://{service.address}",
                "cluster": AUTH_CLUSTER,
                "timeout": _duration(service.timeout_ms),
            },
            "authorization_response": {
                "allowed_upstream_headers": {"patterns": [{"exact": h} for h in service.headers]}
            },
        },
        failure_mode_allow=False,
    )


def _auth_clusters(config: Config) -> list[dict[str, Any]]:
    service = config.authentication.service
    if service is None:
        return []
    static = _is_ip(parse_address(service.address)[0])
    return [
        {
            "name": AUTH_CLUSTER,
            "type": "STATIC" if static else "STRICT_DNS",
            **({} if static else _system_resolver()),
            "connect_timeout": "1s",
            "circuit_breakers": _circuit_breakers(config.edge),
            "lb_policy": "ROUND_ROBIN",
            "load_assignment": {
                "cluster_name": AUTH_CLUSTER,
                "endpoints": [
                    {"lb_endpoints": [{"endpoint": {"address": _socket(service.address)}}]}
                ],
            },
        }
    ]


def _overload_manager(edge: EdgeLimits) -> dict[str, Any]:
    """Envoy sheds load before its heap runs out: past 90% of ``max_heap_bytes`` it returns
    free memory to the system, past 95% it answers new requests 503 (a JSON body, see
    :func:`_local_replies`). Downstream connections are capped for the whole process."""
    heap = "envoy.resource_monitors.fixed_heap"
    connections = "envoy.resource_monitors.global_downstream_max_connections"
    return {
        "refresh_interval": "0.25s",
        "resource_monitors": [
            _typed(
                heap,
                "envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                max_heap_size_bytes=edge.max_heap_bytes,
            ),
            _typed(
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


def _route(config: Config, overflow: str | None = None) -> dict[str, Any]:
    """The route to the pool (``overflow`` None), or to overflow pool ``overflow``'s gateway
    for requests epp answered with that pool in the overflow header (spillover): matched
    only by that header, which only epp can set (the header_mutation filter strips client
    copies), and removed before the request leaves for the other gateway."""
    match: dict[str, Any] = {"prefix": "/"}
    if overflow is not None:
        match["headers"] = [{"name": OVERFLOW, "string_match": {"exact": overflow}}]
    route = {
        "match": match,
        # Raises the stream's buffer limit above the listener's 1 MiB default: BUFFERED
        # ext_proc answers 413 past it, and the router keeps the body for retries only up to
        # it (a larger body is sent once, without fallback).
        "request_body_buffer_limit": config.routing.max_body_bytes,
        # A replica's own x-epp-scores (one behind another epp) never reaches the client:
        # Envoy removes route response headers before it adds them, so epp's scores replace it.
        "response_headers_to_remove": [SCORES],
        # Explain mode: epp puts every candidate's scores in envoy.lb metadata; echo them to the
        # client. Absent metadata formats as an empty value, and empty headers are not added.
        "response_headers_to_add": [
            {
                "header": {
                    "key": SCORES,
                    "value": f"%DYNAMIC_METADATA({LB_NAMESPACE}:{SCORES})%",
                },
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            },
            # The host of the attempt that answered, after retries: epp moves its accounting
            # there. The router adds it before the encoder filters run, so ext_proc sees it;
            # Envoy's own replies (no upstream host) format it empty and it is not added.
            {
                "header": {"key": SERVED, "value": "%UPSTREAM_HOST%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            },
        ],
        "route": {
            "cluster": POOL_CLUSTER if overflow is None else overflow_cluster(overflow),
            "timeout": "0s",
            "idle_timeout": _duration(round(config.edge.stream_idle_timeout_s * 1000)),
            # Any 5xx of a replica (and resets, refused connections) moves the request to epp's
            # next fallback, at most `fallbacks` times. Envoy retries only until it has
            # forwarded the response headers: a stream that fails after it began is not
            # retried (tests/e2e/test_response_path.py checks both). An overflow gateway's
            # 5xx is its own answer (its epp refused): only connection failures are retried.
            "retry_policy": {
                "retry_on": ("5xx," if overflow is None else "") + "connect-failure,reset,"
                "refused-stream",
                "num_retries": config.routing.fallbacks,
                "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.1s"},
            },
        },
    }
    if overflow is not None:
        route["request_headers_to_remove"] = [OVERFLOW]
    return route


def overflow_cluster(name: str) -> str:
    """The Envoy cluster of overflow pool ``name`` (its gateway)."""
    return f"overflow-{name}"


def _overflow_cluster(name: str, pool: OverflowPool, edge: EdgeLimits) -> dict[str, Any]:
    """An overflow pool's gateway: plain round robin over its addresses (the gateway there
    picks the replica), resolved by Envoy when they are names."""
    static = all(_is_ip(parse_address(a)[0]) for a in pool.gateway)
    return {
        "name": overflow_cluster(name),
        "type": "STATIC" if static else "STRICT_DNS",
        **({} if static else _system_resolver()),
        "connect_timeout": "1s",
        "typed_extension_protocol_options": _http_options(http_protocol_options={}),
        "circuit_breakers": _circuit_breakers(edge),
        "per_connection_buffer_limit_bytes": edge.connection_buffer_bytes,
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": overflow_cluster(name),
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket(a)}} for a in pool.gateway]}
            ],
        },
    }


def _json_reply(
    status_filter: dict[str, Any], error_type: str, code: str, message: str
) -> dict[str, Any]:
    """A local-reply mapper that gives one class of Envoy's own replies an OpenAI error body."""
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}},
        separators=(",", ":"),
    )
    return {
        "filter": status_filter,
        "body_format_override": {
            "text_format_source": {"inline_string": body},
            "content_type": "application/json",
        },
    }


def _status_is(*codes: int) -> dict[str, Any]:
    filters = [
        {
            "status_code_filter": {
                "comparison": {
                    "op": "EQ",
                    "value": {"default_value": c, "runtime_key": f"epp.local_reply.{c}"},
                }
            }
        }
        for c in codes
    ]
    return filters[0] if len(filters) == 1 else {"or_filter": {"filters": filters}}


def _local_replies(config: Config, mode: Mode) -> dict[str, Any]:
    """Clients get JSON errors from Envoy too, not only from epp.

    epp's immediate responses are already JSON and are never 504, never carry upstream response
    flags, and (in buffered mode) never 413, because Envoy refuses an oversized body before epp
    sees it; so these mappers only rewrite replies Envoy made itself.
    """
    mappers = [
        # The edge timeouts (edge.request_timeout_s, request_headers_timeout_s): a client too
        # slow to send its request. Ahead of the codec mapper, which a request whose headers
        # never completed would match too.
        _json_reply(
            _status_is(408),
            "invalid_request_error",
            "request_timeout",
            "The request was not received in time (%RESPONSE_CODE_DETAILS%): send it whole "
            "within the gateway's request timeout.",
        ),
        # Envoy's HTTP codec refusing a request it could not parse (431 for headers over 60 KiB,
        # 400 for control characters, conflicting framing, a bad request line): no request
        # headers were decoded, which is what tells these apart from epp's own 4xx (checked
        # with Envoy 1.40; the DPE response flag is set only after the reply, too late for a
        # mapper). Such replies skip ext_proc (see _ext_proc_filter), or they would be lost
        # before they are written (docs/hostile-input.md).
        _json_reply(
            {
                "and_filter": {
                    "filters": [
                        {
                            "status_code_filter": {
                                "comparison": {
                                    "op": "GE",
                                    "value": {
                                        "default_value": 400,
                                        "runtime_key": "epp.local_reply.codec",
                                    },
                                }
                            }
                        },
                        {
                            "header_filter": {
                                "header": {
                                    "name": ":method",
                                    "present_match": True,
                                    "invert_match": True,
                                }
                            }
                        },
                    ]
                }
            },
            "invalid_request_error",
            "invalid_http_request",
            "Envoy refused the request as malformed HTTP (%RESPONSE_CODE_DETAILS%): keep "
            "headers under 60 KiB, free of control characters, and send one body framing.",
        ),
        _json_reply(
            _status_is(500, 504),
            "server_error",
            "endpoint_picker_unavailable",
            "The endpoint picker failed or timed out (%RESPONSE_CODE_DETAILS%). Retry shortly.",
        ),
        _json_reply(
            {"response_flag_filter": {"flags": ["OM"]}},
            "service_unavailable_error",
            "gateway_overloaded",
            "The gateway is short of memory and refuses new requests for now. Retry shortly.",
        ),
        _json_reply(
            {"response_flag_filter": {"flags": ["UH", "UF", "UO", "URX", "NR", "NC", "UMSDR"]}},
            "service_unavailable_error",
            "upstream_unavailable",
            "No replica could serve this request: the chosen ones could not be reached, or the "
            "endpoint picker gave no answer (%RESPONSE_FLAGS%). Retry shortly.",
        ),
    ]
    if config.authentication.jwt is not None or config.authentication.service is not None:
        # jwt_authn's 401 (a token missing, expired, or not signed by a known key) and the
        # authorization service's refusals (flag UAEX, its status kept).
        mappers.insert(
            0,
            _json_reply(
                {
                    "or_filter": {
                        "filters": [_status_is(401), {"response_flag_filter": {"flags": ["UAEX"]}}]
                    }
                },
                "authentication_error",
                "unauthenticated",
                "The request could not be authenticated (%RESPONSE_CODE_DETAILS%).",
            ),
        )
    if mode == "buffered":
        mappers.insert(
            0,
            _json_reply(
                _status_is(413),
                "invalid_request_error",
                "request_too_large",
                f"Request body exceeds the limit of {config.routing.max_body_bytes} bytes.",
            ),
        )
    return {"mappers": mappers}


def _listener(config: Config, mode: Mode, listen: str, message_timeout_ms: int) -> dict[str, Any]:
    edge = config.edge
    hcm = {
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        # One path for every reader: escaped slashes (%2F, %5C, which servers decode
        # differently) unescaped, then dot segments resolved and slashes merged, before any
        # filter runs; epp matches the API on exactly the path the replica receives.
        # Unescaped rather than refused: Envoy's REJECT_REQUEST answers a bare 400 that no
        # local-reply mapper can tell from epp's own (checked with Envoy 1.40), while the
        # unescaped path gets epp's JSON 404 when it leads off the API.
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
        "common_http_protocol_options": {
            # A server that reads x_priority as x-priority would see what the strip missed.
            "headers_with_underscores_action": "DROP_HEADER",
        },
        # The client has request_timeout_s to send its request, on top of the time epp may
        # hold it (the timer runs until the request has gone upstream). Idle streams: the
        # route's idle_timeout, which overrides this one, says the same.
        "request_timeout": _duration(
            round(edge.request_timeout_s * 1000) + message_timeout_ms
            if edge.request_timeout_s
            else 0
        ),
        "request_headers_timeout": _duration(round(edge.request_headers_timeout_s * 1000)),
        "stream_idle_timeout": _duration(round(edge.stream_idle_timeout_s * 1000)),
        "local_reply_config": _local_replies(config, mode),
        "route_config": {
            "name": "epp",
            "virtual_hosts": [
                {
                    "name": "fleet",
                    "domains": ["*"],
                    # Spilled requests first (matched by the overflow header epp sets).
                    "routes": [
                        *(_route(config, name) for name in config.spillover.pools),
                        _route(config),
                    ],
                }
            ],
        },
        "http_filters": [
            _header_mutation_filter(config),
            *_authentication_filters(config),
            _ext_proc_filter(mode, message_timeout_ms),
            _typed("envoy.filters.http.router", "envoy.extensions.filters.http.router.v3.Router"),
        ],
    }
    return {
        "name": "ingress",
        "address": _socket(listen),
        "per_connection_buffer_limit_bytes": edge.connection_buffer_bytes,
        "filter_chains": [
            {
                "filters": [
                    _typed(
                        "envoy.filters.network.http_connection_manager",
                        "envoy.extensions.filters.network.http_connection_manager.v3."
                        "HttpConnectionManager",
                        **hcm,
                    )
                ]
            }
        ],
    }


def _pool_cluster(config: Config, eds_dir: str | None) -> dict[str, Any]:
    override = _policy(
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        # Metadata only: a header source would let a client pick the replica (header sources
        # are also concatenated with metadata sources, not overridden by them).
        override_host_sources=[{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}}],
        fallback_policy=_unanswered_policy(config, eds_dir),
    )
    marked = _marked_pools(config)
    endpoints = [
        _pool_endpoint(_socket(addr), pool in marked)
        for pool, addrs in config.pools.items()
        for addr in addrs
    ]
    dns = [spec for spec in config.discovery.values() if isinstance(spec, DnsSpec)]
    endpoints += [
        _pool_endpoint(
            {"socket_address": {"address": d.name, "port_value": d.port}}, pool in marked
        )
        for pool, d in config.discovery.items()
        if isinstance(d, DnsSpec)
    ]
    kube = [p for p, spec in config.discovery.items() if isinstance(spec, KubernetesSpec)]
    if kube and eds_dir is None:
        raise ValueError(
            f"pool {kube[0]!r} is discovered from Kubernetes: Envoy learns its endpoints from "
            "the EDS file epp writes; give --eds-dir DIR here and to epp serve"
        )
    cluster: dict[str, Any] = {
        "name": POOL_CLUSTER,
        "type": "EDS" if eds_dir is not None else "STRICT_DNS" if dns else "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": _http_options(http_protocol_options={}),
        "circuit_breakers": _circuit_breakers(config.edge),
        "per_connection_buffer_limit_bytes": config.edge.connection_buffer_bytes,
        "load_balancing_policy": override,
    }
    if eds_dir is not None:
        cluster["eds_cluster_config"] = _eds_config(eds_dir)
        return cluster
    cluster["load_assignment"] = {
        "cluster_name": POOL_CLUSTER,
        "endpoints": [{"lb_endpoints": endpoints}],
    }
    if dns:
        cluster.update(_dns_options(dns))
    return cluster


# Endpoint metadata (envoy.lb) marking the replicas of pools that fail open, when other pools
# fail closed: the default subset of the balancer that runs without epp's answer.
FAIL_OPEN_KEY = "epp_fail_open"


def _unanswered_policy(config: Config, eds_dir: str | None) -> dict[str, Any]:
    """The pool's balancer for a request without epp's answer: no epp could be reached (the
    ext_proc filter lets the request through, ``failure_mode_allow``), or every address of
    epp's list was tried.

    Fail closed (the default, ``epp_unreachable: fail_closed``): a subset balancer with no
    subsets and ``NO_FALLBACK`` never returns a host, so Envoy answers 503 (UH) rather than
    send a request to a replica epp did not choose. Fail open: least request over the replicas
    of the pools that chose ``fail_open`` (all of them, or the default subset of those marked
    with :data:`FAIL_OPEN_KEY` when other pools fail closed). Envoy cannot read the model from
    the body, so with pools serving different models a request may land on a replica of
    another fail-open pool, which answers 404 for a model it does not serve.
    """
    least = _policy(
        "envoy.load_balancing_policies.least_request",
        "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
    )
    if not config.fail_open:
        return _policy(
            "envoy.load_balancing_policies.subset",
            "envoy.extensions.load_balancing_policies.subset.v3.Subset",
            fallback_policy="NO_FALLBACK",
            subset_lb_policy=_policy(
                "envoy.load_balancing_policies.round_robin",
                "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
            ),
        )
    if not _marked_pools(config):
        return least
    if eds_dir is not None:
        raise ValueError(
            "pools that fail open next to pools that fail closed need endpoint metadata, which "
            "the EDS file does not carry: give every pool the same epp_unreachable"
        )
    return _policy(
        "envoy.load_balancing_policies.subset",
        "envoy.extensions.load_balancing_policies.subset.v3.Subset",
        fallback_policy="DEFAULT_SUBSET",
        default_subset={FAIL_OPEN_KEY: True},
        subset_lb_policy=least,
    )


def _marked_pools(config: Config) -> frozenset[str]:
    """Pools whose endpoints carry :data:`FAIL_OPEN_KEY`: the fail-open ones, when some other
    pool fails closed (else no marking is needed)."""
    every = set(config.pools) | set(config.discovery)
    return config.fail_open if every - config.fail_open else frozenset()


def _pool_endpoint(address: dict[str, Any], fail_open: bool) -> dict[str, Any]:
    endpoint: dict[str, Any] = {"endpoint": {"address": address}}
    if fail_open:
        endpoint["metadata"] = {"filter_metadata": {LB_NAMESPACE: {FAIL_OPEN_KEY: True}}}
    return endpoint


def _eds_config(eds_dir: str) -> dict[str, Any]:
    """The pool's hosts come from the file epp writes (epp.discovery.eds): every pool, static,
    DNS or Kubernetes, exactly as epp's router sees it. ``watched_directory`` makes Envoy
    reload on the atomic rename epp does; without a running epp the last file stays in force.
    """
    return {
        "eds_config": {
            "resource_api_version": "V3",
            "path_config_source": {
                "path": str(eds_path(eds_dir)),
                "watched_directory": {"path": str(eds_dir)},
            },
        }
    }


def _dns_options(pools: Sequence[DnsSpec]) -> dict[str, Any]:
    """Envoy resolves DNS pools itself (STRICT_DNS), as often as epp does.

    Every address of every name becomes a host of the one ``pool`` cluster, so override_host
    finds the replicas epp picks and retries walk epp's fallback list as with static pools.
    IP literals of static pools in the same cluster resolve to themselves. TTLs are ignored:
    the interval is the promise (docs/discovery.md).
    """
    resolvers = {d.resolver for d in pools}
    if len(resolvers) > 1:
        raise ValueError(
            "DNS pools name different resolvers; Envoy's pool cluster can use only one"
        )
    options: dict[str, Any] = {
        "dns_refresh_rate": _duration(round(min(d.interval for d in pools) * 1000)),
        "respect_dns_ttl": False,
        "dns_lookup_family": "ALL",
    }
    resolver = resolvers.pop()
    if resolver is None:
        return {**options, **_system_resolver()}
    options["typed_dns_resolver_config"] = _typed(
        "envoy.network.dns_resolver.cares",
        "envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig",
        resolvers=[{"socket_address": {"address": resolver[0], "port_value": resolver[1]}}],
        dns_resolver_options={"no_default_search_domain": True},
    )
    return options


# Every cluster Envoy resolves by name through the system's resolver uses getaddrinfo, not
# Envoy's default c-ares. c-ares reports "no such name" as a successful answer with no
# addresses, and a STRICT_DNS cluster then drops every host; getaddrinfo reports it as a failed
# lookup, and the cluster keeps its hosts until a lookup answers again. Container runtimes make
# that difference matter: their resolv.conf lists the embedded DNS server and the host's, and
# while the embedded one reloads (as it does when a container joins the network) a lookup falls
# through to the host's server, which has never heard of the service. The compose stack's Envoy
# lost its whole pool that way during `up --scale` (a 503 UH), measured in CI. One retry of a
# temporary failure (EAI_AGAIN) per refresh: the next refresh comes soon anyway.
# (A function, not a shared dict: the YAML dumper would write anchors for a shared object.)
def _system_resolver() -> dict[str, Any]:
    return {
        "typed_dns_resolver_config": _typed(
            "envoy.network.dns_resolver.getaddrinfo",
            "envoy.extensions.network.dns_resolver.getaddrinfo.v3.GetAddrInfoDnsResolverConfig",
            num_retries=1,
        )
    }


def _health_addresses(
    config: Config, extproc: Sequence[str], health: Sequence[str | int] | None
) -> list[tuple[str, int]]:
    """Where each epp answers gRPC health checks.

    Explicit ``health`` entries (``host:port`` or a bare port) pair with ``extproc`` by
    position. Without them: one epp uses ``server.health_port`` from the config; several epp
    processes on one machine listen on consecutive ports, health at ext_proc port + 1.
    """
    if health is not None:
        if len(health) != len(extproc):
            raise ValueError(f"{len(health)} health entries for {len(extproc)} extproc entries")
        out = []
        for ep, h in zip(extproc, health, strict=True):
            if isinstance(h, int) or h.isdigit():
                out.append((parse_address(ep)[0], int(h)))
            else:
                out.append(parse_address(h))
        return out
    if len(extproc) == 1:
        return [(parse_address(extproc[0])[0], config.server.health_port)]
    return [(host, port + 1) for host, port in map(parse_address, extproc)]


def _epp_cluster(
    config: Config,
    extproc: Sequence[str],
    health: Sequence[str | int] | None,
    tls: EppTls | None = None,
) -> dict[str, Any]:
    endpoints = []
    for addr, (hc_host, hc_port) in zip(
        extproc, _health_addresses(config, extproc, health), strict=True
    ):
        hc: dict[str, Any] = {"port_value": hc_port}
        if hc_host != parse_address(addr)[0]:
            hc["address"] = {"socket_address": {"address": hc_host, "port_value": hc_port}}
        endpoints.append({"endpoint": {"address": _socket(addr), "health_check_config": hc}})
    static = all(_is_ip(parse_address(a)[0]) for a in extproc)
    cluster: dict[str, Any] = {
        "name": EPP_CLUSTER,
        # Names (compose services, Kubernetes Services) are resolved by Envoy and re-resolved
        # when they change; a STATIC cluster accepts only IP addresses.
        "type": "STATIC" if static else "STRICT_DNS",
        **({} if static else _system_resolver()),
        "connect_timeout": "0.25s",
        # gRPC needs HTTP/2. No connection_keepalive: gRPC servers (grpc-python included)
        # accept a ping without data at most every 5 min by default and answer faster pings
        # with GOAWAY "Too many pings", which killed every in-flight request on the connection
        # 20-30 s into a quiet generation (measured with 5 s pings). Health checks and outlier
        # detection find a dead epp instead.
        "typed_extension_protocol_options": _http_options(http2_protocol_options={}),
        # Not LEAST_REQUEST: a dead epp refuses connections at once, so it always has the
        # fewest open streams and attracted nearly every new stream and retry until it was
        # removed (measured: 70-220 failed requests per SIGKILL). Round robin over streams
        # that live as long as their request balances well enough.
        "lb_policy": "ROUND_ROBIN",
        # Envoy delays a health-only change (a host turning healthy, failing its checks or
        # being ejected) for up to the merge window (default 1 s) when another came less than
        # that before, so its workers' balancers keep the old view. Measured in
        # tests/e2e/test_workers.py: a worker turned healthy 0.16 s after the other one and
        # stayed invisible to the balancer; that other one was killed, and every attempt and
        # retry of the next stream (11 over 0.58 s) went to the dead one, failing the request.
        # With a handful of epps, pushing each change at once costs nothing.
        "common_lb_config": {"update_merge_window": "0s"},
        "circuit_breakers": _circuit_breakers(config.edge),
        "health_checks": [
            {
                # epp answers health checks from the same event loop that routes; give a busy
                # process a full second, and require two misses before calling it unhealthy.
                # A dead epp refuses at once, so a short interval removes it in ~0.5 s.
                "timeout": "1s",
                "interval": "0.25s",
                # The default (60 s) applies while the cluster has no traffic yet.
                "no_traffic_interval": "0.25s",
                "unhealthy_interval": "0.25s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXTPROC_SERVICE},
            }
        ],
        "outlier_detection": {
            # Connection failures to a dead epp are local-origin errors: eject after two.
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 2,
            "consecutive_5xx": 5,
            "interval": "1s",
            "base_ejection_time": "5s",
            # Every epp may be ejected; Envoy's panic mode then tries them all anyway.
            "max_ejection_percent": 100,
        },
        "load_assignment": {
            "cluster_name": EPP_CLUSTER,
            "endpoints": [{"lb_endpoints": endpoints}],
        },
    }
    if tls is not None:
        cluster["transport_socket"] = _upstream_tls(tls)
    return cluster


def bootstrap(
    config: Config,
    *,
    mode: Mode = "buffered",
    listen: str = "127.0.0.1:8080",
    admin: str = "127.0.0.1:9901",
    extproc: Sequence[str] = ("127.0.0.1:9002",),
    health: Sequence[str | int] | None = None,
    message_timeout_ms: int = 2000,
    eds_dir: str | None = None,
    tls: EppTls | None = None,
) -> dict[str, Any]:
    """The bootstrap as a plain dict (see :func:`render`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not extproc:
        raise ValueError("at least one extproc address is needed")
    if message_timeout_ms < 0:
        raise ValueError("message_timeout_ms must be >= 0")
    if config.fail_open and mode == "full-duplex":
        raise ValueError(
            f"pool {sorted(config.fail_open)[0]!r} fails open (epp_unreachable: fail_open), "
            "which needs --mode buffered: in full-duplex mode Envoy fails every request whose "
            "epp cannot be reached"
        )
    for addr in (listen, admin, *extproc):
        parse_address(addr)
    for addrs in config.pools.values():
        for addr in addrs:
            # override_host matches hosts by address string, so endpoints must be IPs.
            ipaddress.ip_address(parse_address(addr)[0])
    out: dict[str, Any] = {}
    if eds_dir is not None:
        # Envoy requires a node identity for any xDS subscription, file-based ones included.
        out["node"] = {"id": "envoy", "cluster": "epp-gateway"}
    return out | {
        "admin": {"address": _socket(admin)},
        "overload_manager": _overload_manager(config.edge),
        "static_resources": {
            "listeners": [_listener(config, mode, listen, _fit_queue(config, message_timeout_ms))],
            "clusters": [
                _pool_cluster(config, eds_dir),
                _epp_cluster(config, extproc, health, tls),
                *(_overflow_cluster(n, p, config.edge) for n, p in config.spillover.pools.items()),
                *_auth_clusters(config),
            ],
        },
    }


def render(
    config: Config,
    *,
    mode: Mode = "buffered",
    listen: str = "127.0.0.1:8080",
    admin: str = "127.0.0.1:9901",
    extproc: Sequence[str] = ("127.0.0.1:9002",),
    health: Sequence[str | int] | None = None,
    message_timeout_ms: int = 2000,
    eds_dir: str | None = None,
    tls: EppTls | None = None,
) -> str:
    """Envoy 1.40 bootstrap YAML routing every request through epp.

    ``extproc`` lists the epp processes (``host:port``); ``health`` optionally gives each one's
    gRPC health address (``host:port`` or port), by position; see :func:`_health_addresses`
    for the defaults. ``eds_dir``: Envoy reads the pool's endpoints from the EDS file
    ``epp serve --eds-dir`` writes there (needed for Kubernetes pools; docs/discovery.md).
    ``tls``: reach epp over TLS (docs/security.md). Raises ValueError on a malformed address.
    """
    data = bootstrap(
        config,
        mode=mode,
        listen=listen,
        admin=admin,
        extproc=extproc,
        health=health,
        message_timeout_ms=message_timeout_ms,
        eds_dir=eds_dir,
        tls=tls,
    )
    header = (
        f"# Envoy bootstrap generated by `epp envoy-config` (mode: {mode}) from "
        f"{Path(config.source).name or 'an epp config'}.\n"
        "# Regenerate instead of editing; see envoy/README.md.\n"
    )
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def seed_eds(eds_dir: str | Path, config: Config) -> None:
    """Write the EDS file Envoy needs to start, with the configuration's static endpoints."""
    Path(eds_dir).mkdir(parents=True, exist_ok=True)
    EdsFile(eds_dir, POOL_CLUSTER).write(config.pools)


def add_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``epp envoy-config`` on the ``epp`` command's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "envoy-config",
        help="print an Envoy bootstrap that routes through epp",
        description="Render an Envoy 1.40 bootstrap from an epp configuration file.",
    )
    p.add_argument("--config", "-c", required=True, help="epp YAML configuration file")
    p.add_argument("--mode", choices=MODES, default="buffered", help="request body mode")
    p.add_argument("--listen", default="127.0.0.1:8080", help="Envoy listener host:port")
    p.add_argument("--admin", default="127.0.0.1:9901", help="Envoy admin host:port")
    p.add_argument(
        "--extproc",
        action="append",
        metavar="HOST:PORT",
        help="an epp ext_proc address; repeat for several epp processes "
        "(default 127.0.0.1:<server.extproc_port>)",
    )
    p.add_argument(
        "--health",
        action="append",
        metavar="HOST:PORT",
        help="gRPC health address (HOST:PORT or PORT) of each --extproc, in the same order "
        "(default: server.health_port for one epp, ext_proc port + 1 for several)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="epp serve --workers N behind the --extproc address: list its N workers "
        "(ports +10i) as endpoints of the epp cluster",
    )
    p.add_argument("--message-timeout-ms", type=int, default=2000, help="ext_proc message timeout")
    p.add_argument(
        "--eds-dir",
        help="read the pool's endpoints from the EDS file epp serve --eds-dir writes in this "
        "directory (required for Kubernetes pools)",
    )
    p.add_argument(
        "--extproc-ca",
        metavar="FILE",
        help="reach epp over TLS (server.tls), trusting this CA (PEM); needs --extproc-san",
    )
    p.add_argument(
        "--extproc-san",
        metavar="NAME",
        help="the DNS name or IP address epp's certificate must carry (also sent as SNI)",
    )
    p.add_argument(
        "--client-cert",
        metavar="FILE",
        help="Envoy's client certificate for epp's mutual TLS (server.tls.client_ca)",
    )
    p.add_argument("--client-key", metavar="FILE", help="the key of --client-cert")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``epp envoy-config``: 0 on success, 2 on a bad configuration or argument."""
    try:
        config = load_config(args.config)
        extproc = args.extproc or [f"127.0.0.1:{config.server.extproc_port}"]
        health = args.health
        if args.workers != 1:
            extproc, health = _worker_addresses(config, extproc, health, args.workers)
        tls = _tls_args(args)
        text = render(
            config,
            mode=args.mode,
            listen=args.listen,
            admin=args.admin,
            extproc=extproc,
            health=health,
            message_timeout_ms=args.message_timeout_ms,
            eds_dir=args.eds_dir,
            tls=tls,
        )
    except (ConfigError, ValueError) as exc:
        print(f"epp envoy-config: {exc}", file=sys.stderr)
        return 2
    if args.eds_dir and not eds_path(args.eds_dir).exists():
        # Envoy refuses to start without the file; epp serve replaces it once its sources
        # answered. Until then: the static pools' endpoints.
        seed_eds(args.eds_dir, config)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _worker_addresses(
    config: Config, extproc: Sequence[str], health: Sequence[str] | None, workers: int
) -> tuple[list[str], list[str]]:
    """The ext_proc and health addresses of ``epp serve --workers`` (epp/workers.py)."""
    from epp.workers import worker_ports

    if len(extproc) != 1 or (health is not None and len(health) != 1):
        raise ValueError("--workers expands one --extproc (and at most one --health)")
    host, port = parse_address(extproc[0])
    hc_host, hc_port = host, config.server.health_port
    if health:
        hc_host, hc_port = (
            (host, int(health[0])) if health[0].isdigit() else parse_address(health[0])
        )
    ports = worker_ports(port, hc_port, config.server.metrics_port, workers)
    return (
        [f"{_bracket(host)}:{p}" for p, _, _ in ports],
        [f"{_bracket(hc_host)}:{h}" for _, h, _ in ports],
    )


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _tls_args(args: argparse.Namespace) -> EppTls | None:
    """The TLS flags as one setting; ValueError names what is missing."""
    if args.extproc_ca is None and args.extproc_san is None:
        if args.client_cert or args.client_key:
            raise ValueError("--client-cert/--client-key need --extproc-ca and --extproc-san")
        return None
    if args.extproc_ca is None or args.extproc_san is None:
        raise ValueError(
            "--extproc-ca and --extproc-san go together (the CA and the name to verify)"
        )
    if (args.client_cert is None) != (args.client_key is None):
        raise ValueError("--client-cert and --client-key go together")
    for path in (args.extproc_ca, args.client_cert, args.client_key):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"no such file: {path} (Envoy reads it at start)")
    # Envoy resolves relative file names against its own working directory, not ours.
    return EppTls(
        _absolute(args.extproc_ca),
        args.extproc_san,
        _absolute(args.client_cert) if args.client_cert else None,
        _absolute(args.client_key) if args.client_key else None,
    )


def _absolute(path: str) -> str:
    return str(Path(path).resolve())
