"""The ``models``, ``pools`` (discovery included) and ``overflow`` sections, and what they say
about each other: a model names pools, a pool names overflow entries, an endpoint belongs to one
pool and to no overflow."""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from epp.admission.spillover import OverflowPool, Spillover
from epp.config.schema import knob, section
from epp.config.walker import Node, read_section
from epp.data_parallel import MAX_RANKS, DataParallel
from epp.discovery.spec import (
    DEFAULT_DNS_INTERVAL,
    DiscoverySpec,
    DnsSpec,
    KubernetesSpec,
    kubernetes_name_problem,
)
from epp.rewrite import Target
from epp.roles import ROLES, Role, parse_role
from epp.tls import ClientTls, client_tls_problems
from epp.wire import DATA_PARALLEL_HEADERS, DATA_PARALLEL_HOST_PORT

# What serves a pool's replicas (docs/sglang.md): decides how their /metrics page reads.
Engine = Literal["vllm", "sglang"]
ENGINES: tuple[Engine, ...] = ("vllm", "sglang")
EPP_UNREACHABLE = ("fail_closed", "fail_open")


def address(node: Node) -> str | None:
    """``IP:port``: Envoy's override_host policy matches endpoints by IP address."""
    value = node.value
    if not isinstance(value, str) or ":" not in value:
        node.report(f"must be 'host:port', got {value!r}")
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        node.report(f"must be 'host:port' with a port in 1..65535, got {value!r}")
        return None
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        node.report(f"must have an IP address as host (Envoy routes by IP), got {host!r}")
        return None
    return value


def host_port(node: Node) -> str | None:
    """``host:port`` where host may be a name (another region's gateway is often one)."""
    value = node.value
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        node.report(f"must be 'host:port' with a port in 1..65535, got {value!r}")
        return None
    return str(value)


def host_port_or_empty(node: Node) -> str:
    return host_port(node) or ""


def host_ports(node: Node) -> tuple[str, ...]:
    """A non-empty list of ``host:port``."""
    if node.value == []:
        node.report("must list at least one host:port")
    return tuple(a for a in map(host_port, node.list()) if a is not None)


def role(node: Node) -> Role | None:
    if node.value is None:
        return None
    found = parse_role(node.value)
    if found is None:
        node.report(f"must be one of {', '.join(ROLES)} (or prefill-decode), got {node.value!r}")
    return found


@section("one replica: its address and what epp knows about it")
@dataclass(frozen=True, slots=True)
class EndpointSection:
    address: str | None = knob(
        None, required=True, read=address, shape="IP:port", doc="the replica (Envoy routes by IP)"
    )
    weight: float = knob(1.0, gt=0, doc="relative capacity: weight 2 takes twice the work")
    kv_events: str = knob("", doc="its vLLM KV-event publisher, tcp:// or ipc:// (precise prefix)")
    role: Role | None = knob(
        None, read=role, shape="prefill | decode | both", doc="prefill/decode role (docs/pd.md)"
    )

    def checked(self, node: Node) -> EndpointSection:
        if self.kv_events and not self.kv_events.startswith(("tcp://", "ipc://")):
            node.at("kv_events").report(
                f"must be a tcp:// or ipc:// ZMQ address, got {self.kv_events!r}"
            )
            return dataclasses.replace(self, kv_events="")
        return self


def endpoints(node: Node) -> tuple[EndpointSection, ...]:
    """A pool's ``endpoints``: each ``IP:port`` or a mapping."""
    if node.value == []:
        node.report("must list at least one endpoint")
    found = []
    for item in node.list():
        if isinstance(item.value, dict):
            found.append(read_section(EndpointSection, item))
        else:
            found.append(EndpointSection(address(item)))
    return tuple(found)


def _resolver(node: Node) -> tuple[str, int] | None:
    if node.value is None:
        return None
    text = str(node.value)
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, "53"
    try:
        ip = str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        node.report(f"must be 'ip' or 'ip:port', got {node.value!r}")
        return None
    if not port.isdigit() or not 0 < int(port) < 65536:
        node.report(f"must have a port in 1..65535, got {node.value!r}")
        return None
    return ip, int(port)


@section("a name whose A/AAAA records are the replicas (docs/discovery.md)")
@dataclass(frozen=True, slots=True)
class DnsSection:
    name: str = knob("", required=True, doc="the host name to resolve")
    port: int = knob(0, required=True, ge=1, le=65535, doc="the replicas' port")
    interval: float = knob(DEFAULT_DNS_INTERVAL, gt=0, doc="seconds between resolutions")
    resolver: tuple[str, int] | None = knob(
        None, read=_resolver, shape="ip | ip:port", doc="the DNS server to ask; unset: the system's"
    )
    role: Role | None = knob(
        None, read=role, shape="prefill | decode | both", doc="the role of every replica"
    )

    def checked(self, node: Node) -> DnsSection:
        if node.at("name").value == "":
            node.at("name").report("must be a host name to resolve, got ''")
        return self

    def spec(self) -> DnsSpec:
        return DnsSpec(self.name, self.port, self.interval, self.resolver, self.role)


def _k8s_name(node: Node) -> str:
    problem = kubernetes_name_problem(node.value)
    if problem:
        node.report(problem)
        return ""
    return str(node.value)


@section("an InferencePool and the Ready Pods it selects (docs/discovery.md)")
@dataclass(frozen=True, slots=True)
class KubernetesSection:
    pool_name: str = knob(
        "",
        required=True,
        read=_k8s_name,
        shape="NAME",
        doc="the InferencePool (inference.networking.k8s.io/v1)",
    )
    namespace: str = knob(
        "default",
        read=_k8s_name,
        shape="NAME",
        doc="its namespace",
    )
    kubeconfig: str | None = knob(None, doc="credentials file; unset: the service account")
    api_url: str | None = knob(None, doc="a plain http(s) API URL (kubectl proxy, tests)")

    def checked(self, node: Node) -> KubernetesSection:
        if self.kubeconfig is not None and self.api_url is not None:
            node.report("give kubeconfig or api_url, not both")
        if self.api_url is not None and not self.api_url.startswith(("http://", "https://")):
            node.at("api_url").report(f"must be an http(s) URL, got {self.api_url!r}")
        return self

    def spec(self) -> KubernetesSpec:
        return KubernetesSpec(self.pool_name, self.namespace, self.kubeconfig, self.api_url)


@section("where a pool's endpoints come from instead of a list: exactly one source")
@dataclass(frozen=True, slots=True)
class DiscoverySection:
    dns: DnsSection | None = knob(None, doc="DNS records (compose service, headless Service)")
    kubernetes: KubernetesSection | None = knob(None, doc="an InferencePool's Pods")

    def checked(self, node: Node) -> DiscoverySection:
        if (self.dns is None) == (self.kubernetes is None):
            node.report("must name exactly one source: dns or kubernetes")
        return self

    def spec(self) -> DnsSpec | KubernetesSpec | None:
        if self.dns is not None:
            return self.dns.spec()
        return self.kubernetes.spec() if self.kubernetes is not None else None


@section("how to verify replicas that serve /metrics over https (docs/security.md)")
@dataclass(frozen=True, slots=True)
class ClientTlsSection:
    ca: str | None = knob(None, doc="CA bundle the replicas' certificates chain to")
    cert: str | None = knob(None, doc="client certificate (mutual TLS)")
    key: str | None = knob(None, doc="its key")
    server_name: str | None = knob(None, doc="name to verify instead of the address")

    def tls(self, node: Node) -> ClientTls:
        tls = ClientTls(
            *(value or None for value in (self.ca, self.cert, self.key, self.server_name))
        )
        for name, problem in client_tls_problems(tls):
            node.at(name).report(problem)
        return tls


@section("several data-parallel engines behind each replica (docs/data-parallel.md)")
@dataclass(frozen=True, slots=True)
class DataParallelSection:
    size: int = knob(
        1, ge=1, le=MAX_RANKS, doc="ranks per replica, each scheduled as an endpoint of its own"
    )
    header: str = knob(
        DATA_PARALLEL_HOST_PORT,
        choices=DATA_PARALLEL_HEADERS,
        doc="names the picked rank: llm-d's host:port+rank, or vLLM's rank index",
    )


@section("a set of replicas serving the same models")
@dataclass(frozen=True, slots=True)
class PoolSection:
    endpoints: tuple[EndpointSection, ...] | None = knob(
        None,
        read=endpoints,
        shape="[IP:port | {address, weight, kv_events, role}]",
        entries=EndpointSection,
        doc="the replicas",
    )
    discovery: DiscoverySection | None = knob(None, doc="or: discover them")
    metrics_tls: ClientTlsSection | None = knob(None, doc="scrape /metrics over https")
    overflow: tuple[str, ...] = knob((), doc="overflow entries to spill to while saturated")
    engine: Engine = knob("vllm", doc="what serves the replicas: whose /metrics names they use")
    data_parallel: DataParallelSection | None = knob(
        None, doc="each replica runs several data-parallel ranks"
    )
    epp_unreachable: Literal["fail_closed", "fail_open"] = knob(
        "fail_closed", doc="no epp answers: 503, or Envoy balances the pool itself"
    )

    def checked(self, node: Node) -> PoolSection:
        if self.discovery is not None and self.endpoints is not None:
            node.report("must give either endpoints or discovery, not both")
        elif self.discovery is None and self.endpoints is None:
            node.at("endpoints").report("must be set")
        return self


class Pools(NamedTuple):
    endpoints: dict[str, tuple[str, ...]]
    weights: dict[str, float]
    roles: dict[str, Role]
    kv_events: dict[str, str]
    discovery: dict[str, DiscoverySpec]
    metrics_tls: dict[str, ClientTls]
    fail_open: frozenset[str]
    engines: dict[str, Engine]
    data_parallel: dict[str, DataParallel]


def build_pools(sections: Mapping[str, PoolSection], node: Node) -> Pools:
    """Every pool's endpoint addresses (a discovered pool starts empty: epp.discovery fills it
    at run time) and what the file says about each endpoint and pool."""
    pools = Pools({}, {}, {}, {}, {}, {}, frozenset(), {}, {})
    seen: dict[str, str] = {}
    fail_open = set()
    for name, pool in sections.items():
        here = node.at(name)
        if pool.engine != "vllm":
            pools.engines[name] = pool.engine
        if pool.data_parallel is not None:
            pools.data_parallel[name] = DataParallel(
                pool.data_parallel.size, pool.data_parallel.header
            )
        if pool.epp_unreachable == "fail_open":
            fail_open.add(name)
        if pool.metrics_tls is not None:
            pools.metrics_tls[name] = pool.metrics_tls.tls(here.at("metrics_tls"))
        spec = pool.discovery.spec() if pool.discovery is not None else None
        if spec is not None:
            pools.discovery[name] = spec
        pools.endpoints[name] = _addresses(name, pool, here, pools, seen)
    if not pools.endpoints and node.value is not None:
        node.report("must define at least one pool")
    return pools._replace(fail_open=frozenset(fail_open))


def _addresses(
    name: str, pool: PoolSection, node: Node, into: Pools, seen: dict[str, str]
) -> tuple[str, ...]:
    addrs = []
    for index, ep in enumerate(() if pool.discovery is not None else pool.endpoints or ()):
        addr = ep.address
        if addr is None:
            continue
        if addr in seen:
            node.at("endpoints").at(index).report(
                f"must be unique: {addr} is already an endpoint of pool '{seen[addr]}'"
            )
            continue
        seen[addr] = name
        addrs.append(addr)
        if ep.weight != 1.0:
            into.weights[addr] = ep.weight
        if ep.kv_events:
            into.kv_events[addr] = ep.kv_events
        if ep.role is not None:
            into.roles[addr] = ep.role
    return tuple(addrs)


@section("one share of a rewritten model's requests")
@dataclass(frozen=True, slots=True)
class RewriteSection:
    model: str = knob("", required=True, doc="the model these requests go to (it has pools)")
    weight: int = knob(1, ge=1, doc="its share, relative to the other targets' weights")


def _rewrite(node: Node) -> tuple[Target, ...]:
    """``models.NAME.rewrite``: the weighted targets."""
    if node.value == []:
        node.report("must list at least one target")
    targets = (read_section(RewriteSection, entry) for entry in node.list())
    return tuple(Target(t.model, t.weight) for t in targets if t.model)


@section("a model name clients send, the pools that serve it, and how to read its prompts")
@dataclass(frozen=True, slots=True)
class ModelConfig:
    pools: tuple[str, ...] = knob((), doc="the pools serving it (required unless rewrite)")
    lora: bool = knob(False, doc="the name is a LoRA adapter loaded on the pools' replicas")
    # Local Hugging Face tokenizer directory, for scorers that need the engine's token ids.
    tokenizer: str | None = knob(None, doc="tokenizer directory, for the precise prefix scorer")
    rewrite: tuple[Target, ...] = knob(
        (),
        read=_rewrite,
        shape="[{model, weight}]",
        entries=RewriteSection,
        doc="requests go to these models, a share each by weight (docs/rewrite.md)",
    )
    rewrite_sticky: bool = knob(
        True, doc="a session stays on one rewrite target; false: every request draws"
    )

    def checked(self, node: Node) -> ModelConfig:
        if not self.rewrite and node.at("pools").value is None:
            node.at("pools").report("must be set")
        elif node.at("pools").value == []:
            node.at("pools").report("must name at least one pool")
        if self.tokenizer and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            node.at("tokenizer").report(
                f"must be a directory with tokenizer.json, got {self.tokenizer!r}"
            )
        return dataclasses.replace(self, tokenizer=self.tokenizer or None)


def build_models(
    sections: Mapping[str, ModelConfig], node: Node, pools: Mapping[str, tuple[str, ...]]
) -> dict[str, ModelConfig]:
    models: dict[str, ModelConfig] = {}
    for name, model in sections.items():
        refs = node.at(name).at("pools")
        known = []
        for index, pool in enumerate(model.pools):
            if pool in pools:
                known.append(pool)
            else:
                refs.at(index).report(
                    f"must name a pool, got unknown pool {pool!r} (pools: {', '.join(pools)})"
                )
        models[name] = dataclasses.replace(model, pools=tuple(known))
    if not models and node.value is not None:
        node.report("must define at least one model")
    served = {name for name, spec in models.items() if spec.pools}
    for name, model in models.items():
        for i, target in enumerate(model.rewrite):
            if target.model not in served:
                node.at(name).at("rewrite").at(i).at("model").report(
                    f"must name a model with pools, got {target.model!r}"
                )
    return models


@section("another region's pool, reached through its own gateway (docs/admission.md#spillover)")
@dataclass(frozen=True, slots=True)
class OverflowSection:
    gateway: tuple[str, ...] = knob(
        (), required=True, read=host_ports, shape="[host:port]", doc="its gateway"
    )
    endpoints: tuple[str, ...] = knob(
        (), required=True, read=host_ports, shape="[host:port]", doc="its replicas (scraped)"
    )
    max_requests: int = knob(0, ge=0, doc="requests spilled to it at once (0: no limit)")


def build_spillover(
    overflow: Mapping[str, OverflowSection], pools: Mapping[str, PoolSection], root: Node
) -> Spillover:
    """The ``overflow`` section, and each pool's ``overflow`` list naming its entries."""
    home = {ep.address for pool in pools.values() for ep in pool.endpoints or ()}
    entries: dict[str, OverflowPool] = {}
    for name, entry in overflow.items():
        node = root.at("overflow").at(name)
        if name in pools:
            node.report(f"must not share a name with pool {name!r}")
        for index, addr in enumerate(entry.endpoints):
            if addr in home:
                node.at("endpoints").at(index).report(
                    f"must not be an endpoint of a home pool, got {addr}"
                )
        entries[name] = OverflowPool(entry.gateway, entry.endpoints, entry.max_requests)
    routes: dict[str, tuple[str, ...]] = {}
    for pool, spec in pools.items():
        for index, ref in enumerate(spec.overflow):
            if ref not in entries:
                root.at("pools").at(pool).at("overflow").at(index).report(
                    f"must name an entry of the overflow section, got {ref!r}"
                )
        if spec.overflow:
            routes[pool] = tuple(r for r in spec.overflow if r in entries)
    return Spillover(entries, routes)
