"""Render the Envoy 1.40 bootstrap that fronts a vLLM fleet with epp as its endpoint picker.

``epp envoy-config --config epp.yaml`` prints it; :func:`render` is the library entry point.
Every choice below was checked against the real Envoy 1.40 binary (``tests/unit/
test_envoy_config.py`` runs traffic through it); ``envoy/README.md`` explains them for operators.

The pieces, in request order:

* **header_mutation before ext_proc** strips the control headers a client could send
  (``x-gateway-destination-endpoint`` and friends), so epp never sees a forged answer and the
  upstream never receives one.
* **ext_proc** streams the request to epp (cluster ``epp``) and fails closed
  (``failure_mode_allow: false``): without epp's decision the request gets a 500/504 rather
  than landing on an arbitrary replica. epp's answer comes back as ``envoy.lb`` dynamic
  metadata, which Envoy applies only because the namespace is listed in
  ``metadata_options.receiving_namespaces``. The stream stays open until the response is
  complete (``response_trailer_mode: SEND``, see :func:`_processing_mode`).
* **route ``/``** has no timeout (``timeout: 0s``, ``idle_timeout: 0s``: a generation may run
  for minutes, silent when not streamed) and a retry policy with ``num_retries =
  routing.fallbacks``, so an unreachable replica makes Envoy try the next entry of epp's list.
* **cluster ``pool``** is a STATIC cluster holding every endpoint of every pool, balanced by the
  ``override_host`` policy that reads ONLY the metadata (never the header: metadata cannot be
  set by a client). Each attempt (first try, then each retry) consumes the next address of the
  comma list. When the list is absent or used up, the fallback policy is a subset balancer with
  no subsets and ``NO_FALLBACK``: it never returns a host, so Envoy answers 503 "no healthy
  upstream" instead of silently picking a random replica.
* **cluster ``epp``** holds one or more epp processes (active-active) over HTTP/2. A stream
  that cannot reach an epp is retried on another (``grpc_service.retry_policy``); gRPC health
  checks on each epp's health port and outlier detection take a dead or draining epp out of
  rotation. Measured: hard-killing one of two epps under load failed only the requests whose
  streams were open on it (tests/e2e/test_active_active.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from epp.config import Config, ConfigError, load_config

Mode = Literal["buffered", "full-duplex"]
MODES: tuple[Mode, ...] = ("buffered", "full-duplex")

LB_NAMESPACE = "envoy.lb"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
DESTINATION = "x-gateway-destination-endpoint"
CONTROL_HEADERS = (
    DESTINATION,
    "x-gateway-destination-endpoint-subset",
    "x-gateway-destination-endpoint-served",
)
EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
POOL_CLUSTER = "pool"
EPP_CLUSTER = "epp"

# Envoy's default circuit breakers allow 1024 concurrent requests per cluster and 3 concurrent
# retries. Each in-flight LLM request holds one request on ``pool`` and one ext_proc stream on
# ``epp`` for its whole life (minutes for long generations), so the defaults would turn a busy
# fleet into 503s/500s. epp does admission control; Envoy should not be the throttle.
_UNLIMITED = 1_000_000

_TYPE = "@type"
_T = "type.googleapis.com/"


def parse_address(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host without brackets, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    return host.strip("[]"), int(port)


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


def _circuit_breakers() -> dict[str, Any]:
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": _UNLIMITED,
                "max_pending_requests": _UNLIMITED,
                "max_requests": _UNLIMITED,
                "max_retries": _UNLIMITED,
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
    """Request headers and body go to epp; response headers and body are not sent.

    ``response_trailer_mode: SEND`` is there for the stream's lifetime, not for trailers (vLLM
    over HTTP/1.1 sends none, so no message results). Measured with Envoy 1.40: when nothing is
    left to send on the response path, full-duplex mode half-closes the ext_proc stream right
    after epp's last body chunk, before the upstream has even answered; with SEND it stays open
    until the response completes (or the client goes away), in both modes, so epp can count a
    request as in flight for exactly as long as it is. An upstream that does send trailers costs
    one ``response_trailers`` message, which epp must answer.

    Full-duplex also requires ``request_trailer_mode: SEND`` (Envoy rejects the config
    otherwise; the rule is per direction: SEND trailers wherever a body is FULL_DUPLEX_STREAMED).
    """
    body = "BUFFERED" if mode == "buffered" else "FULL_DUPLEX_STREAMED"
    return {
        "request_header_mode": "SEND",
        "response_header_mode": "SKIP",
        "request_body_mode": body,
        "response_body_mode": "NONE",
        "request_trailer_mode": "SKIP" if mode == "buffered" else "SEND",
        "response_trailer_mode": "SEND",
    }


def _ext_proc_filter(mode: Mode, message_timeout_ms: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        # No grpc_service.timeout: it would be a deadline on the whole stream, which lives as
        # long as the HTTP request.
        "grpc_service": {
            "envoy_grpc": {"cluster_name": EPP_CLUSTER},
            # A stream that cannot reach an epp (dead process, refused, reset or UNAVAILABLE
            # before epp's first answer) is replayed on another epp instead of failing the
            # request with a 500. Retries here can land on the dead epp again (measured:
            # previous_hosts does not keep them off it), so they must outlast the health checks
            # that remove it: 4 retries backing off 25 -> 250 ms span ~0.4 s. Measured (SIGKILL
            # of one of two epps under 8 clients, 6 runs): 0 requests started after the kill
            # failed, only streams epp had already answered; with 2 retries over 10-50 ms and
            # no "reset", up to 200 did.
            "retry_policy": {
                "retry_on": "connect-failure,refused-stream,unavailable,reset",
                "num_retries": 4,
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
        "failure_mode_allow": False,
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
    return _typed(
        "envoy.filters.http.ext_proc",
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        **config,
    )


def _header_mutation_filter() -> dict[str, Any]:
    return _typed(
        "envoy.filters.http.header_mutation",
        "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        mutations={"request_mutations": [{"remove": h} for h in CONTROL_HEADERS]},
    )


def _route(config: Config) -> dict[str, Any]:
    return {
        "match": {"prefix": "/"},
        # Raises the stream's buffer limit above the listener's 1 MiB default: BUFFERED
        # ext_proc answers 413 past it, and the router keeps the body for retries only up to
        # it (a larger body is sent once, without fallback).
        "request_body_buffer_limit": config.routing.max_body_bytes,
        # Explain mode: epp puts every candidate's scores in envoy.lb metadata; echo them to the
        # client. Absent metadata formats as an empty value, and empty headers are not added.
        "response_headers_to_add": [
            {
                "header": {
                    "key": "x-epp-scores",
                    "value": f"%DYNAMIC_METADATA({LB_NAMESPACE}:x-epp-scores)%",
                },
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ],
        "route": {
            "cluster": POOL_CLUSTER,
            "timeout": "0s",
            "idle_timeout": "0s",
            "retry_policy": {
                "retry_on": "connect-failure,reset,refused-stream,retriable-status-codes",
                "retriable_status_codes": [503],
                "num_retries": config.routing.fallbacks,
                "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.1s"},
            },
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
        _json_reply(
            _status_is(500, 504),
            "server_error",
            "endpoint_picker_unavailable",
            "The endpoint picker failed or timed out (%RESPONSE_CODE_DETAILS%). Retry shortly.",
        ),
        _json_reply(
            {"response_flag_filter": {"flags": ["UH", "UF", "UO", "URX", "NR", "NC", "UMSDR"]}},
            "service_unavailable_error",
            "upstream_unavailable",
            "The replica chosen for this request could not be reached (%RESPONSE_FLAGS%). "
            "Retry shortly.",
        ),
    ]
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
    hcm = {
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        "local_reply_config": _local_replies(config, mode),
        "route_config": {
            "name": "epp",
            "virtual_hosts": [{"name": "fleet", "domains": ["*"], "routes": [_route(config)]}],
        },
        "http_filters": [
            _header_mutation_filter(),
            _ext_proc_filter(mode, message_timeout_ms),
            _typed("envoy.filters.http.router", "envoy.extensions.filters.http.router.v3.Router"),
        ],
    }
    return {
        "name": "ingress",
        "address": _socket(listen),
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


def _pool_cluster(config: Config) -> dict[str, Any]:
    never = _policy(
        "envoy.load_balancing_policies.subset",
        "envoy.extensions.load_balancing_policies.subset.v3.Subset",
        # No selectors and NO_FALLBACK: this balancer never returns a host. It runs only when
        # epp's metadata is missing or every listed address was tried, and then the request
        # must fail (503 UH) rather than go to a replica epp did not choose.
        fallback_policy="NO_FALLBACK",
        subset_lb_policy=_policy(
            "envoy.load_balancing_policies.round_robin",
            "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
        ),
    )
    override = _policy(
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        # Metadata only: a header source would let a client pick the replica (header sources
        # are also concatenated with metadata sources, not overridden by them).
        override_host_sources=[{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}}],
        fallback_policy=never,
    )
    endpoints = [
        {"endpoint": {"address": _socket(addr)}}
        for addrs in config.pools.values()
        for addr in addrs
    ]
    return {
        "name": POOL_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": _http_options(http_protocol_options={}),
        "circuit_breakers": _circuit_breakers(),
        "load_balancing_policy": override,
        "load_assignment": {
            "cluster_name": POOL_CLUSTER,
            "endpoints": [{"lb_endpoints": endpoints}],
        },
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
    config: Config, extproc: Sequence[str], health: Sequence[str | int] | None
) -> dict[str, Any]:
    endpoints = []
    for addr, (hc_host, hc_port) in zip(
        extproc, _health_addresses(config, extproc, health), strict=True
    ):
        hc: dict[str, Any] = {"port_value": hc_port}
        if hc_host != parse_address(addr)[0]:
            hc["address"] = {"socket_address": {"address": hc_host, "port_value": hc_port}}
        endpoints.append({"endpoint": {"address": _socket(addr), "health_check_config": hc}})
    return {
        "name": EPP_CLUSTER,
        "type": "STATIC",
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
        "circuit_breakers": _circuit_breakers(),
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


def bootstrap(
    config: Config,
    *,
    mode: Mode = "buffered",
    listen: str = "127.0.0.1:8080",
    admin: str = "127.0.0.1:9901",
    extproc: Sequence[str] = ("127.0.0.1:9002",),
    health: Sequence[str | int] | None = None,
    message_timeout_ms: int = 2000,
) -> dict[str, Any]:
    """The bootstrap as a plain dict (see :func:`render`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not extproc:
        raise ValueError("at least one extproc address is needed")
    if message_timeout_ms < 0:
        raise ValueError("message_timeout_ms must be >= 0")
    for addr in (listen, admin, *extproc):
        parse_address(addr)
    for addrs in config.pools.values():
        for addr in addrs:
            # override_host matches hosts by address string, so endpoints must be IPs.
            ipaddress.ip_address(parse_address(addr)[0])
    return {
        "admin": {"address": _socket(admin)},
        "static_resources": {
            "listeners": [_listener(config, mode, listen, message_timeout_ms)],
            "clusters": [_pool_cluster(config), _epp_cluster(config, extproc, health)],
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
) -> str:
    """Envoy 1.40 bootstrap YAML routing every request through epp.

    ``extproc`` lists the epp processes (``host:port``); ``health`` optionally gives each one's
    gRPC health address (``host:port`` or port), by position; see :func:`_health_addresses`
    for the defaults. Raises ValueError on a malformed address.
    """
    data = bootstrap(
        config,
        mode=mode,
        listen=listen,
        admin=admin,
        extproc=extproc,
        health=health,
        message_timeout_ms=message_timeout_ms,
    )
    header = (
        f"# Envoy bootstrap generated by `epp envoy-config` (mode: {mode}) from "
        f"{Path(config.source).name or 'an epp config'}.\n"
        "# Regenerate instead of editing; see envoy/README.md.\n"
    )
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def add_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``epp envoy-config`` on the ``epp`` command's subparsers."""
    p = subparsers.add_parser(
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
    p.add_argument("--message-timeout-ms", type=int, default=2000, help="ext_proc message timeout")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``epp envoy-config``: 0 on success, 2 on a bad configuration or argument."""
    try:
        config = load_config(args.config)
        extproc = args.extproc or [f"127.0.0.1:{config.server.extproc_port}"]
        text = render(
            config,
            mode=args.mode,
            listen=args.listen,
            admin=args.admin,
            extproc=extproc,
            health=args.health,
            message_timeout_ms=args.message_timeout_ms,
        )
    except (ConfigError, ValueError) as exc:
        print(f"epp envoy-config: {exc}", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
