"""The ``epp`` cluster: the epp processes (active-active) over HTTP/2, their gRPC health checks
and outlier detection, and TLS towards them (:class:`EppTls`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp.config import Config
from epp.envoy_config.common import (
    EPP_CLUSTER,
    EXTPROC_SERVICE,
    http_options,
    is_ip,
    parse_address,
    socket_address,
    system_resolver,
    typed,
)
from epp.envoy_config.limits import circuit_breakers


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
    san_type = "IP_ADDRESS" if is_ip(tls.san) else "DNS"
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
    return typed(
        "envoy.transport_sockets.tls",
        "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        sni=tls.san,
        common_tls_context=common,
    )


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


def epp_cluster(
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
        endpoints.append({"endpoint": {"address": socket_address(addr), "health_check_config": hc}})
    static = all(is_ip(parse_address(a)[0]) for a in extproc)
    cluster: dict[str, Any] = {
        "name": EPP_CLUSTER,
        # Names (compose services, Kubernetes Services) are resolved by Envoy and re-resolved
        # when they change; a STATIC cluster accepts only IP addresses.
        "type": "STATIC" if static else "STRICT_DNS",
        **({} if static else system_resolver()),
        "connect_timeout": "0.25s",
        # gRPC needs HTTP/2. No connection_keepalive: gRPC servers (grpc-python included)
        # accept a ping without data at most every 5 min by default and answer faster pings
        # with GOAWAY "Too many pings", which killed every in-flight request on the connection
        # 20-30 s into a quiet generation (measured with 5 s pings). Health checks and outlier
        # detection find a dead epp instead.
        "typed_extension_protocol_options": http_options(http2_protocol_options={}),
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
        "circuit_breakers": circuit_breakers(config.edge),
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
