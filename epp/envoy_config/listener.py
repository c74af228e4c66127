"""The listener: path normalisation, the edge timeouts, the HTTP filter chain (header strip,
authentication, ext_proc, router) and the routes to the pool and to overflow gateways."""

from __future__ import annotations

from typing import Any

from epp.config import Config
from epp.envoy_config.auth import authentication_filters
from epp.envoy_config.common import POOL_CLUSTER, Mode, duration, socket_address, typed
from epp.envoy_config.ext_proc import ext_proc_filter
from epp.envoy_config.pool import overflow_cluster
from epp.envoy_config.replies import local_replies
from epp.wire import CONTROL_HEADERS, LB_NAMESPACE, OVERFLOW, SCORES, SERVED


def listener(config: Config, mode: Mode, listen: str, message_timeout_ms: int) -> dict[str, Any]:
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
        "request_timeout": duration(
            round(edge.request_timeout_s * 1000) + message_timeout_ms
            if edge.request_timeout_s
            else 0
        ),
        "request_headers_timeout": duration(round(edge.request_headers_timeout_s * 1000)),
        "stream_idle_timeout": duration(round(edge.stream_idle_timeout_s * 1000)),
        "local_reply_config": local_replies(config, mode),
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
            *authentication_filters(config),
            ext_proc_filter(mode, message_timeout_ms),
            typed("envoy.filters.http.router", "envoy.extensions.filters.http.router.v3.Router"),
        ],
    }
    return {
        "name": "ingress",
        "address": socket_address(listen),
        "per_connection_buffer_limit_bytes": edge.connection_buffer_bytes,
        "filter_chains": [
            {
                "filters": [
                    typed(
                        "envoy.filters.network.http_connection_manager",
                        "envoy.extensions.filters.network.http_connection_manager.v3."
                        "HttpConnectionManager",
                        **hcm,
                    )
                ]
            }
        ],
    }


def _header_mutation_filter(config: Config) -> dict[str, Any]:
    # First in the chain, so last on the response: the served-endpoint header the route adds
    # for epp is gone before the client sees it, even when epp did not process the response.
    policy = config.request
    # Identity headers from clients never reach epp or the pool, unless a gateway in front of
    # this Envoy sets them (request.trusted_headers); jwt_authn / ext_authz set them later.
    identity = () if policy.trusted_headers else policy.identity_headers()
    return typed(
        "envoy.filters.http.header_mutation",
        "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        mutations={
            "request_mutations": [{"remove": h} for h in (*CONTROL_HEADERS, *identity)],
            "response_mutations": [{"remove": SERVED}],
        },
    )


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
            "idle_timeout": duration(round(config.edge.stream_idle_timeout_s * 1000)),
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
