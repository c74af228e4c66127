"""The ``discovery:`` section of a pool as frozen specs.

:mod:`epp.config` declares and validates the section's keys and builds these specs. Two specs
compare equal when they describe the same source, so a reload that leaves a pool's discovery
unchanged keeps its running source (and its membership).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epp.roles import Role

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


def kubernetes_name_problem(value: Any) -> str:
    """What is wrong with ``value`` as a Kubernetes object name, or ""."""
    if isinstance(value, str) and _K8S_NAME.match(value):
        return ""
    return f"must be a Kubernetes object name, got {value!r}"


def kubernetes_override(
    pools: Mapping[str, Any], pool_name: str, namespace: str, kubeconfig: str | None = None
) -> dict[str, KubernetesSpec]:
    """``epp serve --pool-name``: which configured pool the InferencePool feeds, as GIE's EPP
    serves exactly one pool.

    The pool of the same name if the file has one, else the file's only pool; with several
    pools and none of that name, ValueError asks the user to name one.
    """
    for flag, name in (("--pool-name", pool_name), ("--pool-namespace", namespace)):
        if kubernetes_name_problem(name):
            raise ValueError(f"{flag}: {kubernetes_name_problem(name)}")
    spec = KubernetesSpec(pool_name, namespace, kubeconfig)
    if pool_name in pools:
        return {pool_name: spec}
    if len(pools) == 1:
        return {next(iter(pools)): spec}
    raise ValueError(
        f"--pool-name {pool_name}: the configuration has several pools ({', '.join(pools)}) "
        "and none of that name; rename the pool the InferencePool should feed to "
        f"{pool_name!r}, or use pools.<name>.discovery.kubernetes in the file"
    )
