"""The ext_proc filter that streams each request and its response to epp: processing modes,
failure mode, message timeout (raised above the flow-control queue's TTL), the retry policy
towards the epp cluster, and the matcher that keeps Envoy's own replies away from it."""

from __future__ import annotations

from typing import Any

from epp.config import Config
from epp.envoy_config.common import EPP_CLUSTER, Mode, duration, typed
from epp.wire import LB_NAMESPACE, SERVED, SUBSET_HINT_NAMESPACE


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


def fit_queue(config: Config, message_timeout_ms: int) -> int:
    """The message timeout, raised above the flow-control queue's longest TTL when epp may hold
    requests (buffered mode: the held body answer is one message). An epp that stops answering
    still has its held requests released by Envoy, at TTL + margin instead of never."""
    if config.flow_control.mode != "queue":
        return message_timeout_ms
    ttl_ms = int(config.flow_control.limits.longest_ttl * 1000)
    return max(message_timeout_ms, ttl_ms + QUEUE_TIMEOUT_MARGIN_MS)


def ext_proc_filter(mode: Mode, message_timeout_ms: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        # No grpc_service.timeout: it would be a deadline on the whole stream, which lives as
        # long as the HTTP request.
        "grpc_service": _grpc_service(),
        # Buffered: a late failure of epp (a crash while the response streams) must not cut the
        # response; the pool still refuses requests epp did not place (package docstring).
        # Full duplex holds the body in epp's hands, so Envoy cannot go on without it: Envoy
        # 1.40 fails a FULL_DUPLEX_STREAMED request whose processor dies or cannot be reached
        # even with failure_mode_allow: true (measured: 500 for an unreachable epp, the client
        # stream reset for one that dies mid-response; benchmarks/failover.py).
        "failure_mode_allow": mode == "buffered",
        # Per message (buffered: the body answer includes scheduling time). Full-duplex bodies
        # are not covered by it (Envoy 1.40).
        "message_timeout": duration(message_timeout_ms),
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
    processor = typed(
        "envoy.filters.http.ext_proc",
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        **config,
    )
    # Envoy's own replies (its HTTP codec refusing malformed requests, the buffer limit's 413)
    # skip ext_proc on the way out. Processing them gained nothing, and while ext_proc held
    # their headers for epp the codec closed the connection, so the client got no response at
    # all (docs/hostile-input.md). Upstream responses always carry the served-endpoint header
    # the route adds; local replies never do, so epp still sees every upstream response.
    return typed(
        "envoy.filters.http.ext_proc",
        "envoy.extensions.common.matching.v3.ExtensionWithMatcher",
        extension_config=processor,
        xds_matcher={
            "matcher_list": {
                "matchers": [
                    {
                        "predicate": {"not_matcher": _has_header(SERVED)},
                        "on_match": {
                            "action": typed(
                                "skip-local-replies",
                                "envoy.extensions.filters.common.matcher.action.v3.SkipFilter",
                            )
                        },
                    }
                ]
            }
        },
    )


def _grpc_service() -> dict[str, Any]:
    """How the ext_proc filter reaches epp: the ``epp`` cluster, with retries onto another
    epp for a stream that cannot reach one."""
    return {
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
                typed(
                    "envoy.retry_host_predicates.previous_hosts",
                    "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate",
                )
            ],
            "host_selection_retry_max_attempts": 3,
        },
    }


def _has_header(name: str) -> dict[str, Any]:
    """A matcher predicate: the response carries header ``name`` (any value)."""
    return {
        "single_predicate": {
            "input": typed(
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
