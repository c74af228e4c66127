"""The clusters requests go to: ``pool`` (every replica, balanced only by epp's answer, with the
fail-closed or fail-open balancer for requests epp did not answer; static, DNS or EDS hosts)
and each overflow pool's gateway (spillover)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epp.admission.spillover import OverflowPool
from epp.config import Config
from epp.discovery.eds import eds_path
from epp.discovery.spec import DnsSpec, KubernetesSpec
from epp.edge import EdgeLimits
from epp.envoy_config.common import (
    POOL_CLUSTER,
    duration,
    http_options,
    is_ip,
    lb_policy,
    parse_address,
    socket_address,
    system_resolver,
    typed,
)
from epp.envoy_config.limits import circuit_breakers
from epp.wire import DESTINATION, LB_NAMESPACE


def pool_cluster(config: Config, eds_dir: str | None) -> dict[str, Any]:
    override = lb_policy(
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        # Metadata only: a header source would let a client pick the replica (header sources
        # are also concatenated with metadata sources, not overridden by them).
        override_host_sources=[{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}}],
        fallback_policy=_unanswered_policy(config, eds_dir),
    )
    marked = _marked_pools(config)
    endpoints = [
        _pool_endpoint(socket_address(addr), pool in marked)
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
        "typed_extension_protocol_options": http_options(http_protocol_options={}),
        "circuit_breakers": circuit_breakers(config.edge),
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
    least = lb_policy(
        "envoy.load_balancing_policies.least_request",
        "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
    )
    if not config.fail_open:
        return lb_policy(
            "envoy.load_balancing_policies.subset",
            "envoy.extensions.load_balancing_policies.subset.v3.Subset",
            fallback_policy="NO_FALLBACK",
            subset_lb_policy=lb_policy(
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
    return lb_policy(
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
        "dns_refresh_rate": duration(round(min(d.interval for d in pools) * 1000)),
        "respect_dns_ttl": False,
        "dns_lookup_family": "ALL",
    }
    resolver = resolvers.pop()
    if resolver is None:
        return {**options, **system_resolver()}
    options["typed_dns_resolver_config"] = typed(
        "envoy.network.dns_resolver.cares",
        "envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig",
        resolvers=[{"socket_address": {"address": resolver[0], "port_value": resolver[1]}}],
        dns_resolver_options={"no_default_search_domain": True},
    )
    return options


def overflow_cluster(name: str) -> str:
    """The Envoy cluster of overflow pool ``name`` (its gateway)."""
    return f"overflow-{name}"


def overflow_gateway_cluster(name: str, pool: OverflowPool, edge: EdgeLimits) -> dict[str, Any]:
    """An overflow pool's gateway: plain round robin over its addresses (the gateway there
    picks the replica), resolved by Envoy when they are names."""
    static = all(is_ip(parse_address(a)[0]) for a in pool.gateway)
    return {
        "name": overflow_cluster(name),
        "type": "STATIC" if static else "STRICT_DNS",
        **({} if static else system_resolver()),
        "connect_timeout": "1s",
        "typed_extension_protocol_options": http_options(http_protocol_options={}),
        "circuit_breakers": circuit_breakers(edge),
        "per_connection_buffer_limit_bytes": edge.connection_buffer_bytes,
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": overflow_cluster(name),
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": socket_address(a)}} for a in pool.gateway
                    ]
                }
            ],
        },
    }
