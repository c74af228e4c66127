"""The ``discovery:`` section of a pool, parsed into frozen specs.

Kept apart from :mod:`epp.config` so the configuration module only needs one call:
:func:`parse_discovery` takes the raw YAML value and raises ``ValueError`` with a message whose
first word is the offending key below ``discovery`` (``dns.port: ...``); the caller prefixes the
pool's path. Two specs compare equal when they describe the same source, so a reload that leaves
a pool's discovery unchanged keeps its running source (and its membership).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epp.roles import ROLES, Role, parse_role

DEFAULT_DNS_INTERVAL = 1.0

# RFC 1123 labels, as Kubernetes names objects.
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True, slots=True)
class StaticSpec:
    """The pool's ``endpoints:`` list."""

    endpoints: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DnsSpec:
    """A name whose A/AAAA records are the replicas (compose service, headless Service)."""

    name: str
    port: int
    interval: float = DEFAULT_DNS_INTERVAL
    # ``(ip, port)`` of the DNS server to ask; None uses the system resolver (getaddrinfo:
    # /etc/hosts, search domains, whatever the container runtime set up).
    resolver: tuple[str, int] | None = None
    # The prefill/decode role of every replica the name resolves to (epp.roles; None: both).
    role: Role | None = None


@dataclass(frozen=True, slots=True)
class KubernetesSpec:
    """An InferencePool (inference.networking.k8s.io/v1) and the Ready Pods it selects."""

    pool_name: str
    namespace: str = "default"
    # Credentials: in-cluster service account unless one of these is given. ``api_url`` is a
    # plain URL without authentication (tests, ``kubectl proxy``); ``kubeconfig`` a file.
    kubeconfig: str | None = None
    api_url: str | None = None


DiscoverySpec = StaticSpec | DnsSpec | KubernetesSpec


def format_endpoint(ip: str, port: int) -> str:
    """``ip:port``, with brackets around IPv6 addresses (as Envoy and epp's config write them)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def parse_discovery(value: Any) -> DnsSpec | KubernetesSpec:
    """Parse a pool's ``discovery`` mapping; ValueError names the bad key."""
    data = _mapping(value, "discovery")
    kinds = [k for k in data if k in ("dns", "kubernetes")]
    _only(data, "", "dns", "kubernetes")
    if len(kinds) != 1:
        raise ValueError("must name exactly one source: dns or kubernetes")
    if kinds[0] == "dns":
        return _dns(_mapping(data["dns"], "dns"))
    return _kubernetes(_mapping(data["kubernetes"], "kubernetes"))


def _dns(data: Mapping[str, Any]) -> DnsSpec:
    _only(data, "dns.", "name", "port", "interval", "resolver", "role")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"dns.name: is required, a host name to resolve (got {name!r})")
    port = _port(data.get("port"), "dns.port")
    interval = data.get("interval", DEFAULT_DNS_INTERVAL)
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0:
        raise ValueError(f"dns.interval: must be a number of seconds > 0, got {interval!r}")
    resolver = data.get("resolver")
    role = None
    if data.get("role") is not None:
        role = parse_role(data["role"])
        if role is None:
            raise ValueError(f"dns.role: must be one of {', '.join(ROLES)}, got {data['role']!r}")
    return DnsSpec(
        name, port, float(interval), None if resolver is None else _resolver(resolver), role
    )


def _resolver(value: Any) -> tuple[str, int]:
    text = str(value)
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, "53"
    try:
        ip = str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        raise ValueError(f"dns.resolver: must be 'ip' or 'ip:port', got {value!r}") from None
    return ip, _port(int(port) if port.isdigit() else port, "dns.resolver")


def _kubernetes(data: Mapping[str, Any]) -> KubernetesSpec:
    _only(data, "kubernetes.", "pool_name", "namespace", "kubeconfig", "api_url")
    names = {}
    for key, default in (("pool_name", None), ("namespace", "default")):
        value = data.get(key, default)
        if not isinstance(value, str) or not _K8S_NAME.match(value):
            raise ValueError(f"kubernetes.{key}: must be a Kubernetes object name, got {value!r}")
        names[key] = value
    kubeconfig = data.get("kubeconfig")
    api_url = data.get("api_url")
    # (absent keys and explicit nulls mean the same: in-cluster credentials)
    if kubeconfig is not None and api_url is not None:
        raise ValueError("kubernetes: give kubeconfig or api_url, not both")
    if api_url is not None and not str(api_url).startswith(("http://", "https://")):
        raise ValueError(f"kubernetes.api_url: must be an http(s) URL, got {api_url!r}")
    return KubernetesSpec(
        names["pool_name"],
        names["namespace"],
        None if kubeconfig is None else str(kubeconfig),
        None if api_url is None else str(api_url),
    )


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must be a mapping, got {type(value).__name__}")
    return value


def _only(data: Mapping[str, Any], prefix: str, *keys: str) -> None:
    for key in data:
        if key not in keys:
            raise ValueError(f"{prefix}{key}: unknown key (expected one of: {', '.join(keys)})")


def _port(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"{where}: must be a port in 1..65535, got {value!r}")
    return value


def kubernetes_override(
    pools: Mapping[str, Any], pool_name: str, namespace: str, kubeconfig: str | None = None
) -> dict[str, KubernetesSpec]:
    """``epp serve --pool-name``: which configured pool the InferencePool feeds, as GIE's EPP
    serves exactly one pool.

    The pool of the same name if the file has one, else the file's only pool; with several
    pools and none of that name, ValueError asks the user to name one.
    """
    spec = _kubernetes({"pool_name": pool_name, "namespace": namespace, "kubeconfig": kubeconfig})
    if pool_name in pools:
        return {pool_name: spec}
    if len(pools) == 1:
        return {next(iter(pools)): spec}
    raise ValueError(
        f"--pool-name {pool_name}: the configuration has several pools ({', '.join(pools)}) "
        "and none of that name; rename the pool the InferencePool should feed to "
        f"{pool_name!r}, or use pools.<name>.discovery.kubernetes in the file"
    )
