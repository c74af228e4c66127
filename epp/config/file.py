"""The whole file: its sections (:class:`File`, read by the walker), and the :class:`Config`
the rest of epp reads, built from them once every section is read."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from epp.admission import SaturationDetector
from epp.admission.budgets import BudgetPolicy
from epp.admission.spillover import Spillover
from epp.config.admission import AdmissionSection, FlowControl, build_admission
from epp.config.pools import (
    Engine,
    ModelConfig,
    OverflowSection,
    PoolSection,
    build_models,
    build_pools,
    build_spillover,
)
from epp.config.request import RequestSection, build_request
from epp.config.scheduling import SchedulingConfig, SchedulingSection, build_scheduling
from epp.config.schema import Reload, knob, policies, section
from epp.config.sections import (
    AutoscalingSection,
    BudgetsSection,
    EdgeSection,
    HealthSection,
    RoutingConfig,
    ScrapeConfig,
    ServerConfig,
    StoreConfig,
    TracingSection,
    domain,
)
from epp.config.walker import ConfigError, Node, read_section
from epp.data_parallel import DataParallel, Rank
from epp.discovery.spec import DiscoverySpec
from epp.edge import Authentication, EdgeLimits
from epp.metrics.demand import DemandPolicy
from epp.request import RequestPolicy, api_for_path
from epp.roles import Role
from epp.state.health import HealthConfig
from epp.tls import ClientTls
from epp.tracing import TracingConfig


# Problems are listed section by section in this order, whatever the order of the file's keys.
@section("the configuration file; every section but models and pools is optional")
@dataclass(frozen=True, slots=True)
class File:
    pools: Mapping[str, PoolSection] = knob(
        factory=dict, required=True, doc="pool name -> its replicas"
    )
    scrape: ScrapeConfig = knob(factory=ScrapeConfig, doc="replica metrics")
    request: RequestSection = knob(factory=RequestSection, doc="identity and objectives")
    models: Mapping[str, ModelConfig] = knob(
        factory=dict, required=True, doc="model name (the body's model) -> how it is served"
    )
    scheduling: SchedulingSection = knob(factory=SchedulingSection, doc="plugins and profiles")
    server: ServerConfig = knob(factory=ServerConfig, doc="epp's own servers")
    routing: RoutingConfig = knob(factory=RoutingConfig, doc="the answer to Envoy")
    # Read by `epp envoy-config` only: Envoy takes it when re-rendered and restarted.
    edge: EdgeSection = knob(factory=EdgeSection, doc="Envoy's limits")
    autoscaling: AutoscalingSection = knob(factory=AutoscalingSection, doc="replica demand")
    admission: AdmissionSection = knob(factory=AdmissionSection, doc="saturation, flow control")
    overflow: Mapping[str, OverflowSection] = knob(factory=dict, doc="spillover pools")
    budgets: BudgetsSection = knob(factory=BudgetsSection, doc="tenant budgets")
    store: StoreConfig = knob(factory=StoreConfig, doc="state shared by several epps")
    health: HealthSection = knob(factory=HealthSection, doc="passive health")
    tracing: TracingSection = knob(factory=TracingSection, doc="OpenTelemetry")


@dataclass(frozen=True, slots=True)
class Config:
    models: Mapping[str, ModelConfig]
    pools: Mapping[str, tuple[str, ...]]
    scheduling: SchedulingConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    request: RequestPolicy = field(default_factory=RequestPolicy)
    # The rendered Envoy's authenticating filters (request.jwt, request.auth_service).
    authentication: Authentication = field(default_factory=Authentication)
    edge: EdgeLimits = field(default_factory=EdgeLimits)
    admission: SaturationDetector = field(default_factory=SaturationDetector)
    autoscaling: DemandPolicy = field(default_factory=DemandPolicy)
    flow_control: FlowControl = field(default_factory=lambda: FlowControl())
    spillover: Spillover = field(default_factory=Spillover)
    budgets: BudgetPolicy = field(default_factory=BudgetPolicy)
    store: StoreConfig = field(default_factory=StoreConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    # Relative capacity of endpoints (default 1.0): a replica of weight 2 takes twice the work.
    weights: Mapping[str, float] = field(default_factory=dict)
    # ZMQ address of each endpoint's vLLM KV-event publisher (tcp://host:port), where known.
    kv_events: Mapping[str, str] = field(default_factory=dict)
    # Prefill/decode role of endpoints (epp.roles; missing means ``both``): the file's, and at
    # run time what discovery learned (DNS ``role``, the Pods' ``llm-d.ai/role`` label).
    roles: Mapping[str, Role] = field(default_factory=dict)
    # Pools whose endpoints are discovered (their ``pools`` entry starts empty; the server
    # fills it in as the source publishes, see epp.discovery).
    discovery: Mapping[str, DiscoverySpec] = field(default_factory=dict)
    # Pools whose replicas serve /metrics over https, and how to verify them.
    metrics_tls: Mapping[str, ClientTls] = field(default_factory=dict)
    # Pools with ``epp_unreachable: fail_open``: when no epp answers, Envoy routes their
    # requests itself (least request over the pool's replicas) instead of answering 503.
    fail_open: frozenset[str] = frozenset()
    # The serving engine of each pool whose replicas are not vLLM (how their /metrics read).
    engines: Mapping[str, Engine] = field(default_factory=dict)
    # Pools whose replicas run several data-parallel ranks (epp.data_parallel), and at run time
    # each rank endpoint the server made of them.
    data_parallel: Mapping[str, DataParallel] = field(default_factory=dict)
    ranks: Mapping[str, Rank] = field(default_factory=dict)
    source: str = ""

    def endpoint_pools(self) -> dict[str, str]:
        """Every configured endpoint address mapped to its pool."""
        return {addr: pool for pool, addrs in self.pools.items() for addr in addrs}

    def endpoints_for_model(self, model: str) -> tuple[str, ...] | None:
        """Addresses that may serve ``model``, or None if the model is not configured."""
        spec = self.models.get(model)
        if spec is None:
            return None
        return tuple(addr for pool in spec.pools for addr in self.pools[pool])


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML file; raise :class:`ConfigError` listing every problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read configuration file: {exc.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    return parse_config(data, source=str(path))


def parse_config(data: Any, source: str = "<config>") -> Config:
    """Validate ``data`` (the YAML file's contents); every problem, each with its key path, in
    one :class:`ConfigError`."""
    errors: list[str] = []
    root = Node(data, "", source, errors)
    if data is not None and not isinstance(data, dict):
        root.mapping()
        raise ConfigError(errors)
    config = build(read_section(File, root), root)
    if errors:
        raise ConfigError(sorted(errors, key=lambda e: _rank(e.removeprefix(f"{source}: "))))
    return config


_ORDER = {name: rank for rank, name in enumerate(File.__dataclass_fields__)}


def _rank(problem: str) -> int:
    """Where the section a problem names comes in :class:`File` (the top level first)."""
    return _ORDER.get(re.split(r"[.\[:]", problem, maxsplit=1)[0], -1)


def build(file: File, root: Node) -> Config:
    """The :class:`Config` of a file whose sections are read, with what one section says about
    another checked (models name pools, overflow entries, passthrough pools)."""
    pools = build_pools(file.pools, root.at("pools"))
    identity = build_request(file.request, root.at("request"))
    admission = build_admission(file.admission, file.scrape.interval)
    return Config(
        models=build_models(file.models, root.at("models"), pools.endpoints),
        pools=pools.endpoints,
        scheduling=build_scheduling(file.scheduling, root.at("scheduling")),
        server=file.server,
        scrape=file.scrape,
        routing=_routing(file.routing, root.at("routing"), pools.endpoints),
        request=identity.policy,
        authentication=identity.authentication,
        edge=domain(EdgeLimits, file.edge),
        autoscaling=domain(DemandPolicy, file.autoscaling),
        admission=admission.saturation,
        flow_control=admission.flow_control,
        spillover=build_spillover(file.overflow, file.pools, root),
        budgets=file.budgets.policy(),
        store=file.store,
        health=domain(HealthConfig, file.health),
        tracing=domain(TracingConfig, file.tracing),
        weights=pools.weights,
        roles=pools.roles,
        kv_events=pools.kv_events,
        discovery=pools.discovery,
        metrics_tls=pools.metrics_tls,
        fail_open=pools.fail_open,
        engines=pools.engines,
        data_parallel=pools.data_parallel,
        source=root.source,
    )


def _routing(
    routing: RoutingConfig, node: Node, pools: Mapping[str, tuple[str, ...]]
) -> RoutingConfig:
    """``routing`` with only the passthrough prefixes that name a pool and no inference API."""
    passthrough: dict[str, str] = {}
    for prefix, pool in node.child("passthrough").items():
        if not prefix.startswith("/"):
            pool.report("must be keyed by a path prefix starting with '/'")
        elif api_for_path(prefix) is not None:
            pool.report("is an inference API path: epp routes it by its body, not through")
        elif not isinstance(pool.value, str) or pool.value not in pools:
            pool.report(f"must name a pool (one of {', '.join(sorted(pools)) or 'none'})")
        else:
            passthrough[prefix] = pool.value
    return dataclasses.replace(routing, passthrough=passthrough)


def section_policies() -> dict[str, Reload]:
    """Every top-level section and what a reload does with it."""
    return {key: p for key, p in policies(File, Reload.APPLIED).items() if "." not in key}


def reload_policy(key: str) -> Reload:
    """What a reload does with ``key`` (``scrape.interval``, ``pools.*.engine``, ``server``)."""
    found = policies(File, Reload.APPLIED)
    if key not in found:
        raise KeyError(f"no configuration key {key!r}")
    return found[key]


def reloadable_keys() -> list[str]:
    """Every reloadable key, dotted (a mapping's names as ``*``)."""
    return [
        key for key, policy in policies(File, Reload.APPLIED).items() if policy is Reload.APPLIED
    ]
