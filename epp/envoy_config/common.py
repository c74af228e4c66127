"""The building blocks every part of the bootstrap uses: the body modes, the cluster names,
addresses, durations, typed extensions and the system DNS resolver."""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

Mode = Literal["buffered", "full-duplex"]
MODES: tuple[Mode, ...] = ("buffered", "full-duplex")

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
POOL_CLUSTER = "pool"
EPP_CLUSTER = "epp"

_TYPE = "@type"
_T = "type.googleapis.com/"


def parse_address(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host without brackets, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    return host.strip("[]"), int(port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def socket_address(value: str) -> dict[str, Any]:
    host, port = parse_address(value)
    return {"socket_address": {"address": host, "port_value": port}}


def duration(ms: int) -> str:
    return f"{ms / 1000:g}s"


def typed(name: str, type_name: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "typed_config": {_TYPE: _T + type_name, **config}}


def lb_policy(name: str, type_name: str, **config: Any) -> dict[str, Any]:
    """A ``LoadBalancingPolicy`` with a single typed extension."""
    return {"policies": [{"typed_extension_config": typed(name, type_name, **config)}]}


def http_options(**explicit: Any) -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            _TYPE: _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": explicit,
        }
    }


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
def system_resolver() -> dict[str, Any]:
    return {
        "typed_dns_resolver_config": typed(
            "envoy.network.dns_resolver.getaddrinfo",
            "envoy.extensions.network.dns_resolver.getaddrinfo.v3.GetAddrInfoDnsResolverConfig",
            num_retries=1,
        )
    }
