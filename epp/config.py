"""The one YAML file that configures epp: plain frozen data, validated up front.

Shape (every section optional except ``models`` and ``pools``)::

    models:   {NAME: {pools: [POOL, ...], lora: bool, tokenizer: DIR,
                     rewrite: [{model: MODEL, weight: int}, ...]}}  (docs/rewrite.md)
    pools:    {POOL: {endpoints: [host:port | {address, weight, kv_events, role}, ...]}
                    | {discovery: {dns: {...}} | {kubernetes: {...}}},
                     metrics_tls: {ca, cert, key, server_name},  (docs/discovery.md, security.md)
                     overflow: [OVERFLOW, ...], engine: vllm|sglang,  (sglang.md)
                     epp_unreachable: fail_closed|fail_open}  (active-active.md)
    overflow: {OVERFLOW: {gateway: [host:port, ...], endpoints: [host:port, ...], max_requests}}
              (spillover, docs/admission.md)
    server:   {host, extproc_port, health_port, metrics_port, log_level, drain_seconds, ...,
               tls: {cert, key, client_ca}, debug_access: local|loopback|any,
               debug_token | debug_token_file, max_buffered_bytes}
    scrape:   {interval, timeout, failure_threshold}
    routing:  {fallbacks, max_body_bytes, explain, explain_token | explain_token_file,
               inject_stream_usage, learned_capacity}
    autoscaling: {target_utilisation, replica_concurrency, window_seconds}
    request:  {session_header, priority_header, objective_header, fairness_header,
               objectives: {NAME: int | {priority, spill}}, trusted_headers,
               api_keys: {KEY: {tenant, objective}} | api_keys_file, engine_priority,
               jwt: {jwks_file, issuer, audiences, tenant_claim, objective_claim, required},
               auth_service: {address, headers, timeout_ms}}  (docs/identity.md)
    edge:     {max_requests, max_pending_requests, max_retries, max_connections,
               max_heap_bytes, request_timeout_s, request_headers_timeout_s,
               stream_idle_timeout_s, connection_buffer_bytes}  (Envoy's limits, docs/deploy.md)
    admission: {mode: off|shed|queue, queue_threshold, kv_threshold, stale_seconds,
                max_requests, max_tokens, sheddable_reserve, pool_reserve, capacity, ttl,
                bands: {PRIORITY: {capacity, ttl}}, scope: group|local}
    budgets:  {tenants: {FAIRNESS_ID: {rpm, tpm}}, default: {rpm, tpm}, window_seconds}
              (tenant budgets, docs/admission.md)
    scheduling: {profile, plugins: [{name, type, parameters}], profiles: {NAME: [{plugin, weight}]}}
    store:    {backend: memory|redis, redis_url | redis_url_file, key_prefix,
               redis_username | redis_username_file, redis_password | redis_password_file}
    health:   {enabled, consecutive_failures, error_rate, window_seconds, min_requests, ...}
              (passive health, docs/health.md)
    tracing:  {endpoint, sample_ratio, service_name}  (OpenTelemetry, docs/tracing.md)

Validation reads the whole file and reports every problem, each with its key path
(``scheduling.plugins[0].parameters.tokens_per_request: must be an integer >= 1, got 1.5``), in
one :class:`ConfigError`; every profile is checked, selected or not. A :class:`Config` holds no
live objects: the router builds the selected profile's plugins from its specification
(:mod:`epp.scheduling.builder`). :data:`SECTIONS` says which sections a reload applies.

Secrets need not be inline (:mod:`epp.secrets`): each secret key (``server.debug_token``,
``routing.explain_token``, ``store.redis_url``, ``store.redis_username``,
``store.redis_password``) expands ``${NAME}`` from the environment, or is read from the file
its ``_file`` twin names (``store.redis_password_file: /run/secrets/redis/password``; one
trailing newline dropped). ``request.api_keys_file`` names a YAML file holding the
``request.api_keys`` mapping, and every API key expands ``${NAME}`` too. The Redis username
and password are merged into ``store.redis_url`` (which must then carry no password itself).
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar, cast

import yaml

from epp.admission import SaturationDetector
from epp.admission.budgets import BudgetPolicy, Limits
from epp.admission.flow_queue import BandLimits, QueueLimits
from epp.admission.saturation import DEFAULT_STALE_SECONDS
from epp.admission.spillover import OverflowPool, Spillover
from epp.discovery.spec import DiscoverySpec, parse_discovery
from epp.edge import Authentication, AuthService, EdgeLimits, JwtAuth
from epp.metrics.demand import DemandPolicy
from epp.request import ApiKey, LatencyTarget, RequestPolicy, api_for_path
from epp.rewrite import Target
from epp.roles import ROLES, Role, parse_role
from epp.scheduling import (
    PluginSpec,
    ProfileSpec,
    decider_problems,
    plugin_class,
    plugin_types,
    profile_problems,
)
from epp.scheduling.params import parse_params
from epp.secrets import SecretError, expand, read_file
from epp.state.health import LATENCY_RULES, HealthConfig
from epp.state.shared.connect import SCHEMES as REDIS_SCHEMES
from epp.state.shared.connect import has_password, with_credentials
from epp.tls import ClientTls, ServerTls, client_tls_problems, server_tls_problems
from epp.tracing import TracingConfig

T = TypeVar("T")


class ConfigError(ValueError):
    """Configuration problems; ``errors`` lists every one, each starting with the file and the
    dotted path of the bad key."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


class Reload(enum.Enum):
    """What a configuration reload does with a changed section."""

    APPLIED = "reloadable"
    RESTART = "restart-only"


# Every top-level section and what a reload does with it; the reload logic (epp.server) reads
# only this table. Restart-only sections are bound when the process starts: listening sockets
# (server), the state store's connections (store) and the span exporter's thread (tracing).
SECTIONS: Mapping[str, Reload] = {
    "models": Reload.APPLIED,
    "pools": Reload.APPLIED,
    "server": Reload.RESTART,
    "scrape": Reload.APPLIED,
    "routing": Reload.APPLIED,
    "request": Reload.APPLIED,
    "admission": Reload.APPLIED,
    "budgets": Reload.APPLIED,
    "overflow": Reload.APPLIED,
    "autoscaling": Reload.APPLIED,
    "scheduling": Reload.APPLIED,
    "store": Reload.RESTART,
    "health": Reload.APPLIED,
    "tracing": Reload.RESTART,
    # Read by `epp envoy-config` only: Envoy takes it when re-rendered and restarted.
    "edge": Reload.APPLIED,
}

# The profile used when the file names none. Cache affinity and load meet in one unit in the
# TTFT estimate; load is counted at pick time so bursts cannot herd between scrapes; filters keep
# LoRA requests where the adapter can run and long prompts where they fit. Chosen by
# benchmarks/routing.py (docs/benchmarks.md); GIE's 3:2:2 profile is in benchmarks/profiles.
DEFAULT_PROFILE: list[dict[str, Any]] = [
    {"plugin": "ready-endpoint-filter"},
    {"plugin": "lora-filter"},
    {"plugin": "kv-headroom-filter"},
    {"plugin": "prefix-cache-scorer", "weight": 3},
    {"plugin": "session-affinity-scorer", "weight": 3},
    {"plugin": "lora-affinity-scorer", "weight": 1},
    {"plugin": "inflight-load-scorer", "weight": 3},
    {"plugin": "ttft-scorer", "weight": 4},
    {"plugin": "max-score-picker"},
]


DEBUG_ACCESS = ("local", "loopback", "any")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "0.0.0.0"
    extproc_port: int = 9002
    health_port: int = 9003
    metrics_port: int = 9090
    log_level: str = "info"
    # On SIGTERM: report NOT_SERVING this long so Envoy's health checks move new requests to
    # another epp, then give open streams (long generations) this long to finish.
    drain_seconds: float = 3.0
    shutdown_grace_seconds: float = 30.0
    # TLS (mutual with a client CA) on all three listeners; None: plaintext.
    tls: ServerTls | None = None
    # Who may read /debug/* on the metrics port (epp/admin.py): "local" = loopback peers while
    # no debug_token is set, then only callers sending "Authorization: Bearer <debug_token>"
    # (loopback ones too: a mesh sidecar forwards from loopback); "loopback" = loopback peers
    # always, others with the token (local development); "any" = every caller.
    debug_access: str = "local"
    debug_token: str = field(default="", repr=False)
    # Request-body bytes the process may hold at once (received, not yet routed: being read,
    # or waiting in flow control); a body that does not fit is a 503 with Retry-After, not an
    # out-of-memory kill. 0: no budget. Peak memory is a few times this (parsing copies).
    max_buffered_bytes: int = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    interval: float = 0.05
    timeout: float = 1.0
    failure_threshold: int = 3


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    fallbacks: int = 1
    max_body_bytes: int = 16 * 1024 * 1024
    # Send every candidate's scores in the x-epp-scores response header (debugging aid).
    explain: bool = False
    # With a token, only requests carrying "x-epp-explain: <token>" get the scores (the header
    # is removed before the request goes upstream); without one, every client does.
    explain_token: str = field(default="", repr=False)
    # Add stream_options.include_usage to streaming requests that lack it, so epp learns their
    # token usage, and remove the extra usage chunk from what the client receives.
    inject_stream_usage: bool = False
    # Scorers read each endpoint's capacity from the latency model (docs/learned-latency.md)
    # where the pool gives it no weight; false: 1.0 unless configured. Off by default: on the
    # heterogeneous benchmark it did not beat no weights at all (docs/learned-latency.md).
    learned_capacity: bool = False
    # Paths that are no inference API but should reach the pool anyway (vLLM's /tokenize,
    # /detokenize, /v1/rerank...): path prefix -> pool. Routed at the headers to the pool's
    # least loaded ready replica, body unread; every other unknown path is a 404 from epp.
    passthrough: Mapping[str, str] = field(default_factory=dict)

    def passthrough_pool(self, path: str) -> str | None:
        """The pool a request for ``path`` passes through to, or None (longest prefix wins)."""
        if not self.passthrough:
            return None
        path = path.split("?", 1)[0]
        matches = [p for p in self.passthrough if path == p or path.startswith(p.rstrip("/") + "/")]
        return self.passthrough[max(matches, key=len)] if matches else None

    def explains_to(self, token: str | None, debug_token: str = "") -> bool:
        """Whether a caller that sent ``token`` in x-epp-explain may see the scores: with
        ``explain_token`` (else the server's ``debug_token``) set, only its holders."""
        if not self.explain:
            return False
        expected = self.explain_token or debug_token
        if not expected:
            return True
        return token is not None and hmac.compare_digest(token.encode(), expected.encode())


@dataclass(frozen=True, slots=True)
class StoreConfig:
    backend: str = "memory"
    # What epp connects with, redis_username and redis_password merged in: a secret.
    redis_url: str = field(default="redis://127.0.0.1:6379/0", repr=False)
    key_prefix: str = "epp"
    # Kept apart as well, so a URL given on the command line gets them too.
    redis_username: str = ""
    redis_password: str = field(default="", repr=False)

    def with_url(self, url: str) -> StoreConfig:
        """The Redis store at ``url`` (``epp serve --redis-url``), with the configured
        credentials unless ``url`` carries a password of its own."""
        if self.redis_password and not has_password(url):
            url = with_credentials(url, self.redis_username, self.redis_password)
        return dataclasses.replace(self, backend="redis", redis_url=url)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A model name clients send, the pools that serve it, and how to read its prompts."""

    pools: tuple[str, ...]
    # The name is a LoRA adapter loaded on the pools' replicas (vLLM --lora-modules NAME=...).
    lora: bool = False
    # Local Hugging Face tokenizer directory, for scorers that need the engine's token ids.
    tokenizer: str | None = None
    # Requests for this name go to these models, each a share by weight (docs/rewrite.md);
    # such a model needs no pools of its own.
    rewrite: tuple[Target, ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """Every profile of the file (plus the built-in ``default`` unless the file defines one)
    and the one in use."""

    profile: str = "default"
    profiles: Mapping[str, ProfileSpec] = field(default_factory=dict)

    @property
    def selected(self) -> ProfileSpec:
        return self.profiles[self.profile]


AdmissionMode = Literal["off", "shed", "queue"]
# What serves a pool's replicas (docs/sglang.md): decides how their /metrics page reads.
Engine = Literal["vllm", "sglang"]
ENGINES: tuple[Engine, ...] = ("vllm", "sglang")
AdmissionScope = Literal["group", "local"]


@dataclass(frozen=True, slots=True)
class FlowControl:
    """What happens when a pool is saturated (docs/admission.md): ``off`` routes anyway,
    ``shed`` refuses sheddable (priority < 0) work with 429 and routes the rest, ``queue``
    holds every request in priority bands until the pool has room. ``scope``: ``group``
    orders dispatch over the queues of every epp sharing Redis (bands and fairness shares hold
    group-wide), ``local`` over this process's queue only (the behaviour before, kept to
    compare)."""

    mode: AdmissionMode = "shed"
    limits: QueueLimits = field(default_factory=QueueLimits)
    scope: AdmissionScope = "group"


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
    errors: list[str] = []
    root = _Node(data, "", source, errors)
    if data is not None and not isinstance(data, dict):
        root.mapping()
        raise ConfigError(errors)
    root.only(*SECTIONS)
    pools = _pools(root.child("pools", required=True))
    scrape = _scrape(root.child("scrape"))
    admission = root.child("admission")
    request, authentication = _request(root.child("request"))
    config = Config(
        models=_models(root.child("models", required=True), pools.endpoints),
        pools=pools.endpoints,
        scheduling=_scheduling(root.child("scheduling")),
        server=_server(root.child("server")),
        scrape=scrape,
        routing=_routing(root.child("routing"), pools.endpoints),
        request=request,
        authentication=authentication,
        edge=_edge(root.child("edge")),
        autoscaling=_autoscaling(root.child("autoscaling")),
        admission=_admission(admission, scrape.interval),
        flow_control=_flow_control(admission),
        spillover=_spillover(root, pools.endpoints),
        budgets=_budgets(root.child("budgets")),
        store=_store(root.child("store")),
        health=_health(root.child("health")),
        tracing=_tracing(root.child("tracing")),
        weights=pools.weights,
        roles=pools.roles,
        kv_events=pools.kv_events,
        discovery=pools.discovery,
        metrics_tls=pools.metrics_tls,
        fail_open=frozenset(pools.fail_open),
        engines=pools.engines,
        source=source,
    )
    if errors:
        raise ConfigError(errors)
    return config


def server_problems(server: ServerConfig, source: str = "<config>") -> list[str]:
    """Port problems of a server section, also after command-line overrides: every port in
    1..65535, and no two servers on one port."""
    problems = []
    first: dict[int, str] = {}
    for key in ("extproc_port", "health_port", "metrics_port"):
        port = getattr(server, key)
        if not 1 <= port <= 65535:
            problems.append(f"{source}: server.{key}: must be an integer in [1, 65535], got {port}")
        elif port in first:
            problems.append(
                f"{source}: server.{key}: must differ from server.{first[port]}, both {port}"
            )
        first.setdefault(port, key)
    return problems


class _Node:
    """A value in the YAML tree that knows its dotted path; problems are collected in
    ``errors`` (shared by the whole tree) and parsing goes on with a default, so one pass
    reports everything."""

    def __init__(self, value: Any, path: str, source: str, errors: list[str]) -> None:
        self.value = value
        self.path = path
        self.source = source
        self.errors = errors

    def report(self, message: str) -> None:
        self.errors.append(f"{self.source}: {self.path or '(top level)'}: {message}")

    def mapping(self) -> Mapping[str, Any]:
        if self.value is None:
            return {}
        if not isinstance(self.value, dict):
            self.report(f"must be a mapping, got {type(self.value).__name__}")
            self.value = {}  # reported once; read as empty from now on
        return self.value

    def only(self, *keys: str) -> None:
        for key in self.mapping():
            if key not in keys:
                self.at(str(key)).report(f"must be one of the known keys: {', '.join(keys)}")

    def at(self, key: str | int) -> _Node:
        if isinstance(key, int):
            return _Node(self.value[key], f"{self.path}[{key}]", self.source, self.errors)
        path = f"{self.path}.{key}".lstrip(".")
        return _Node(self.mapping().get(key), path, self.source, self.errors)

    def child(self, key: str, required: bool = False) -> _Node:
        node = self.at(key)
        if required and node.value is None:
            node.report("must be set")
        return node

    def items(self) -> list[tuple[str, _Node]]:
        return [(str(k), self.at(k)) for k in self.mapping()]

    def list(self) -> list[_Node]:
        if self.value is None:
            return []
        if not isinstance(self.value, list):
            self.report(f"must be a list, got {type(self.value).__name__}")
            self.value = []  # reported once; read as empty from now on
        return [self.at(i) for i in range(len(self.value))]

    def get(self, key: str, kind: type[T], default: T) -> T:
        node = self.at(key)
        value = node.value
        if value is None:
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
        node.report(f"must be {_NAMES.get(kind, kind.__name__)}, got {value!r}")
        return default

    def integer(self, key: str, default: int, *, ge: int) -> int:
        value = self.get(key, int, default)
        if value < ge:
            self.at(key).report(f"must be an integer >= {ge}, got {value!r}")
            return default
        return value

    def real(self, key: str, default: float, *, ge: float | None = None) -> float:
        """A number ``>= ge`` when given, else ``> 0``."""
        value = self.get(key, float, default)
        if value >= ge if ge is not None else value > 0:
            return value
        bound = f">= {ge:g}" if ge is not None else "> 0"
        self.at(key).report(f"must be a number {bound}, got {value!r}")
        return default

    def optional_real(self, key: str) -> float | None:
        return None if self.at(key).value is None else self.get(key, float, 0.0)

    def secret(self, key: str) -> str:
        """``key`` with ``${NAME}`` expanded from the environment, or the contents of the
        file ``key_file`` names (:mod:`epp.secrets`); "" when neither is set."""
        path = self.get(f"{key}_file", str, "")
        value = self.at(key).value
        if path and value is not None:
            self.at(f"{key}_file").report(f"must not be set together with {key}")
            return ""
        if not path and value is not None and not isinstance(value, str):
            # Not the value itself, as get() would say: ``redis_password: 1234`` is a secret.
            self.at(key).report(f"must be a string, got {type(value).__name__}")
            return ""
        try:
            return read_file(path) if path else expand(value or "")
        except SecretError as exc:
            self.at(f"{key}_file" if path else key).report(str(exc))
            return ""


_NAMES: dict[type, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
}


def _address(node: _Node) -> str | None:
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
        # Envoy's override_host policy matches endpoints by IP address, not hostname.
        node.report(f"must have an IP address as host (Envoy routes by IP), got {host!r}")
        return None
    return value


class _Pools(NamedTuple):
    endpoints: dict[str, tuple[str, ...]]
    weights: dict[str, float]
    roles: dict[str, Role]
    kv_events: dict[str, str]
    discovery: dict[str, DiscoverySpec]
    metrics_tls: dict[str, ClientTls]
    fail_open: set[str]
    engines: dict[str, Engine]


EPP_UNREACHABLE = ("fail_closed", "fail_open")


def _pools(node: _Node) -> _Pools:
    pools = _Pools({}, {}, {}, {}, {}, {}, set(), {})
    seen: dict[str, str] = {}
    for name, pool in node.items():
        pools.endpoints[name] = _pool(name, pool, pools, seen)
    if not pools.endpoints and node.value is not None:
        node.report("must define at least one pool")
    return pools


def _pool(name: str, pool: _Node, into: _Pools, seen: dict[str, str]) -> tuple[str, ...]:
    """One pool's endpoint addresses; weights, KV-event addresses, a discovery source and how
    to scrape over https go to ``into`` (a discovered pool starts empty: epp.discovery fills it
    at run time)."""
    pool.only("endpoints", "discovery", "metrics_tls", "overflow", "epp_unreachable", "engine")
    engine = pool.get("engine", str, "vllm")
    if engine not in ENGINES:
        pool.at("engine").report(f"must be one of {', '.join(ENGINES)}, got {engine!r}")
    elif engine != "vllm":
        into.engines[name] = cast(Engine, engine)
    unreachable = pool.get("epp_unreachable", str, "fail_closed")
    if unreachable not in EPP_UNREACHABLE:
        pool.at("epp_unreachable").report(
            f"must be one of {', '.join(EPP_UNREACHABLE)}, got {unreachable!r}"
        )
    elif unreachable == "fail_open":
        into.fail_open.add(name)
    if pool.at("metrics_tls").value is not None:
        into.metrics_tls[name] = _client_tls(pool.at("metrics_tls"))
    if pool.at("discovery").value is not None:
        if pool.at("endpoints").value is not None:
            pool.report("must give either endpoints or discovery, not both")
        try:
            into.discovery[name] = parse_discovery(pool.at("discovery").value)
        except ValueError as exc:
            pool.at("discovery").report(str(exc))
        return ()
    endpoints = pool.child("endpoints", required=True)
    if endpoints.value == []:
        endpoints.report("must list at least one endpoint")
    addrs = []
    for ep in endpoints.list():
        if isinstance(ep.value, dict):
            ep.only("address", "weight", "kv_events", "role")
            addr = _address(ep.child("address", required=True))
            weight = ep.real("weight", 1.0)
            role = _role(ep.at("role"))
            events = ep.get("kv_events", str, "")
            if events and not events.startswith(("tcp://", "ipc://")):
                ep.at("kv_events").report(f"must be a tcp:// or ipc:// ZMQ address, got {events!r}")
                events = ""
            if addr is not None and weight != 1.0:
                into.weights[addr] = weight
            if addr is not None and events:
                into.kv_events[addr] = events
            if addr is not None and role is not None:
                into.roles[addr] = role
        else:
            addr = _address(ep)
        if addr is None:
            continue
        if addr in seen:
            ep.report(f"must be unique: {addr} is already an endpoint of pool '{seen[addr]}'")
            continue
        seen[addr] = name
        addrs.append(addr)
    return tuple(addrs)


def _role(node: _Node) -> Role | None:
    if node.value is None:
        return None
    role = parse_role(node.value)
    if role is None:
        node.report(f"must be one of {', '.join(ROLES)} (or prefill-decode), got {node.value!r}")
    return role


def _models(node: _Node, pools: Mapping[str, tuple[str, ...]]) -> dict[str, ModelConfig]:
    models: dict[str, ModelConfig] = {}
    for name, model in node.items():
        model.only("pools", "lora", "tokenizer", "rewrite")
        rewrites = model.at("rewrite").value is not None
        refs = model.child("pools", required=not rewrites)
        if refs.value == []:
            refs.report("must name at least one pool")
        names = []
        for ref in refs.list():
            if ref.value in pools:
                names.append(str(ref.value))
            else:
                ref.report(
                    f"must name a pool, got unknown pool {ref.value!r} (pools: {', '.join(pools)})"
                )
        tokenizer = model.get("tokenizer", str, "") or None
        if tokenizer is not None and not (Path(tokenizer) / "tokenizer.json").is_file():
            model.at("tokenizer").report(
                f"must be a directory with tokenizer.json, got {tokenizer!r}"
            )
        models[name] = ModelConfig(
            tuple(names), model.get("lora", bool, False), tokenizer, _rewrite(model.at("rewrite"))
        )
    if not models and node.value is not None:
        node.report("must define at least one model")
    served = {name for name, spec in models.items() if spec.pools}
    for name, model in node.items():
        for i, target in enumerate(models[name].rewrite):
            if target.model not in served:
                model.at("rewrite").at(i).at("model").report(
                    f"must name a model with pools, got {target.model!r}"
                )
    return models


def _rewrite(node: _Node) -> tuple[Target, ...]:
    """``models.NAME.rewrite``: the weighted targets (weight 1 unless given)."""
    if node.value == []:
        node.report("must list at least one target")
    targets = []
    for entry in node.list():
        entry.only("model", "weight")
        model = entry.get("model", str, "")
        if not model:
            entry.at("model").report("must name the target model")
            continue
        targets.append(Target(model, entry.integer("weight", 1, ge=1)))
    return tuple(targets)


def _server(node: _Node) -> ServerConfig:
    node.only(
        "host",
        "extproc_port",
        "health_port",
        "metrics_port",
        "log_level",
        "drain_seconds",
        "shutdown_grace_seconds",
        "tls",
        "debug_access",
        "debug_token",
        "debug_token_file",
        "max_buffered_bytes",
    )
    d = ServerConfig()
    access = node.get("debug_access", str, d.debug_access)
    if access not in DEBUG_ACCESS:
        node.at("debug_access").report(f"must be one of {', '.join(DEBUG_ACCESS)}, got {access!r}")
        access = d.debug_access
    level = node.get("log_level", str, d.log_level)
    if level.lower() not in ("debug", "info", "warning", "error"):
        node.at("log_level").report(f"must be one of debug, info, warning, error, got {level!r}")
        level = d.log_level
    server = ServerConfig(
        host=node.get("host", str, d.host),
        extproc_port=node.get("extproc_port", int, d.extproc_port),
        health_port=node.get("health_port", int, d.health_port),
        metrics_port=node.get("metrics_port", int, d.metrics_port),
        log_level=level,
        drain_seconds=node.real("drain_seconds", d.drain_seconds, ge=0),
        shutdown_grace_seconds=node.real("shutdown_grace_seconds", d.shutdown_grace_seconds, ge=0),
        tls=_server_tls(node.at("tls")),
        debug_access=access,
        debug_token=node.secret("debug_token"),
        max_buffered_bytes=node.integer("max_buffered_bytes", d.max_buffered_bytes, ge=0),
    )
    node.errors.extend(server_problems(server, node.source))
    return server


def _server_tls(node: _Node) -> ServerTls | None:
    if node.value is None:
        return None
    node.only("cert", "key", "client_ca")
    cert = node.get("cert", str, "")
    key = node.get("key", str, "")
    for name, value in (("cert", cert), ("key", key)):
        if not value:
            node.at(name).report("must be set to a PEM file (TLS needs a certificate and its key)")
    if not cert or not key:
        return None
    tls = ServerTls(cert, key, node.get("client_ca", str, "") or None)
    for name, problem in server_tls_problems(tls):
        node.at(name).report(problem)
    return tls


def _client_tls(node: _Node) -> ClientTls:
    node.only("ca", "cert", "key", "server_name")
    tls = ClientTls(
        *(node.get(key, str, "") or None for key in ("ca", "cert", "key", "server_name"))
    )
    for name, problem in client_tls_problems(tls):
        node.at(name).report(problem)
    return tls


def _scrape(node: _Node) -> ScrapeConfig:
    node.only("interval", "timeout", "failure_threshold")
    d = ScrapeConfig()
    return ScrapeConfig(
        interval=node.real("interval", d.interval),
        timeout=node.real("timeout", d.timeout),
        failure_threshold=node.integer("failure_threshold", d.failure_threshold, ge=1),
    )


def _routing(node: _Node, pools: Mapping[str, tuple[str, ...]]) -> RoutingConfig:
    node.only(
        "fallbacks",
        "max_body_bytes",
        "explain",
        "explain_token",
        "explain_token_file",
        "inject_stream_usage",
        "learned_capacity",
        "passthrough",
    )
    d = RoutingConfig()
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
    return RoutingConfig(
        fallbacks=node.integer("fallbacks", d.fallbacks, ge=0),
        max_body_bytes=node.integer("max_body_bytes", d.max_body_bytes, ge=1),
        explain=node.get("explain", bool, d.explain),
        explain_token=node.secret("explain_token"),
        inject_stream_usage=node.get("inject_stream_usage", bool, d.inject_stream_usage),
        learned_capacity=node.get("learned_capacity", bool, d.learned_capacity),
        passthrough=passthrough,
    )


def _request(node: _Node) -> tuple[RequestPolicy, Authentication]:
    node.only(
        "session_header",
        "priority_header",
        "objective_header",
        "fairness_header",
        "objectives",
        "trusted_headers",
        "api_keys",
        "api_keys_file",
        "engine_priority",
        "jwt",
        "auth_service",
    )
    d = RequestPolicy()
    objectives: dict[str, int] = {}
    spill: set[str] = set()
    targets: dict[str, LatencyTarget] = {}
    for name, value in node.child("objectives").items():
        if isinstance(value.value, dict):
            value.only("priority", "spill", "ttft_ms", "tpot_ms")
            if value.get("spill", bool, False):
                spill.add(name)
            target = _latency_target(value)
            if target:
                targets[name] = target
            value = value.child("priority", required=True)
            if value.value is None:
                continue  # reported as missing
        if not isinstance(value.value, int) or isinstance(value.value, bool):
            value.report(f"must be an integer priority, got {value.value!r}")
            continue
        objectives[name] = value.value
    api_keys: dict[str, ApiKey] = {}
    for key, entry in _api_key_entries(node):
        entry.only("tenant", "objective")
        tenant = entry.get("tenant", str, "")
        if not tenant:
            entry.at("tenant").report("must be a non-empty string (the key's fairness id)")
        objective = entry.get("objective", str, "") or None
        if objective is not None and objective not in objectives:
            entry.at("objective").report(f"must name one of request.objectives, got {objective!r}")
        api_keys[key] = ApiKey(tenant, objective)
    policy = RequestPolicy(
        session_header=node.get("session_header", str, d.session_header).lower(),
        priority_header=node.get("priority_header", str, d.priority_header).lower(),
        objective_header=node.get("objective_header", str, d.objective_header).lower(),
        fairness_header=node.get("fairness_header", str, d.fairness_header).lower(),
        objectives=objectives,
        spill_objectives=frozenset(spill),
        objective_targets=targets,
        trusted_headers=node.get("trusted_headers", bool, d.trusted_headers),
        api_keys=api_keys,
        engine_priority=node.get("engine_priority", bool, d.engine_priority),
    )
    authentication = Authentication(
        _jwt(node.child("jwt")), _auth_service(node.child("auth_service"), policy)
    )
    if policy.trusted_headers and (authentication.jwt or authentication.service):
        node.at("trusted_headers").report(
            "must be false with jwt or auth_service: Envoy then authenticates requests and "
            "sets the identity headers itself, and must strip every client copy"
        )
    if authentication.jwt is not None and api_keys:
        node.at("api_keys").report(
            "cannot be used with jwt: both read the authorization header, and Envoy refuses "
            "a bearer token that is not a valid JWT"
        )
    authenticated = authentication.headers_set(policy.fairness_header, policy.objective_header)
    return dataclasses.replace(policy, authenticated_headers=authenticated), authentication


def _jwt(node: _Node) -> JwtAuth | None:
    """``request.jwt``: tokens verified by Envoy against a local JWKS file."""
    if node.value is None:
        return None
    node.only("jwks_file", "issuer", "audiences", "tenant_claim", "objective_claim", "required")
    jwks = node.get("jwks_file", str, "")
    if not jwks.startswith("/"):
        node.at("jwks_file").report(
            f"must be an absolute path to a JWKS file (Envoy reads it), got {jwks!r}"
        )
    issuer = node.get("issuer", str, "")
    if not issuer:
        node.at("issuer").report("must be a non-empty string (the tokens' iss claim)")
    audiences = []
    for item in node.child("audiences").list():
        if isinstance(item.value, str) and item.value:
            audiences.append(item.value)
        else:
            item.report(f"must be a non-empty string, got {item.value!r}")
    d = JwtAuth("", "")
    claims = {}
    for key, default in (("tenant_claim", d.tenant_claim), ("objective_claim", d.objective_claim)):
        claims[key] = node.get(key, str, default)
        if not claims[key]:
            node.at(key).report("must be a non-empty claim name")
    return JwtAuth(
        jwks_file=jwks,
        issuer=issuer,
        audiences=tuple(audiences),
        tenant_claim=claims["tenant_claim"],
        objective_claim=claims["objective_claim"],
        required=node.get("required", bool, d.required),
    )


def _auth_service(node: _Node, policy: RequestPolicy) -> AuthService | None:
    """``request.auth_service``: an ext_authz service that sets identity headers."""
    if node.value is None:
        return None
    node.only("address", "headers", "timeout_ms")
    address = _host_port(node.child("address", required=True)) or ""
    allowed = policy.identity_headers()
    headers = []
    for item in node.child("headers", required=True).list():
        name = item.value.lower() if isinstance(item.value, str) else None
        if name not in allowed:
            item.report(
                f"must be one of the identity headers {', '.join(allowed)}, got {item.value!r}"
            )
        else:
            headers.append(name)
    return AuthService(
        address=address,
        headers=tuple(headers),
        timeout_ms=node.integer("timeout_ms", AuthService("", ()).timeout_ms, ge=1),
    )


def _edge(node: _Node) -> EdgeLimits:
    """``edge``: the limits the rendered Envoy enforces (epp.edge.EdgeLimits)."""
    d = EdgeLimits()
    node.only(*(f.name for f in dataclasses.fields(EdgeLimits)))
    return EdgeLimits(
        max_requests=node.integer("max_requests", d.max_requests, ge=1),
        max_pending_requests=node.integer("max_pending_requests", d.max_pending_requests, ge=1),
        max_retries=node.integer("max_retries", d.max_retries, ge=1),
        max_connections=node.integer("max_connections", d.max_connections, ge=1),
        # Below this Envoy's own heap at rest would be near the limit.
        max_heap_bytes=node.integer("max_heap_bytes", d.max_heap_bytes, ge=64 * 1024**2),
        request_timeout_s=node.real("request_timeout_s", d.request_timeout_s, ge=0),
        request_headers_timeout_s=node.real(
            "request_headers_timeout_s", d.request_headers_timeout_s, ge=0
        ),
        stream_idle_timeout_s=node.real("stream_idle_timeout_s", d.stream_idle_timeout_s, ge=0),
        connection_buffer_bytes=node.integer(
            "connection_buffer_bytes", d.connection_buffer_bytes, ge=1024
        ),
    )


# An API-key map of a few hundred thousand keys; a larger file is a wrong path.
MAX_API_KEYS_FILE_BYTES = 16 * 1024 * 1024


def _api_key_entries(node: _Node) -> list[tuple[str, _Node]]:
    """``request.api_keys``, or the same mapping from the YAML file ``api_keys_file`` names;
    every key with ``${NAME}`` expanded. Entries are named by position (``api_keys[2]``),
    never by their key: error messages must not echo a secret."""
    keys = node.child("api_keys")
    path = node.get("api_keys_file", str, "")
    if path:
        if keys.value is not None:
            node.at("api_keys_file").report("must not be set together with api_keys")
            return []
        try:
            data = yaml.safe_load(read_file(path, MAX_API_KEYS_FILE_BYTES))
        except SecretError as exc:
            node.at("api_keys_file").report(str(exc))
            return []
        except yaml.YAMLError as exc:
            # Not str(exc): YAML's message quotes the offending line, which may be a key.
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            node.at("api_keys_file").report(f"{path} is not valid YAML{where}")
            return []
        keys = _Node(data, f"{node.path}.api_keys_file", node.source, node.errors)
    entries = []
    for index, (key, entry) in enumerate(keys.items()):
        entry.path = f"{node.path}.api_keys[{index}]"
        try:
            key = expand(key)
        except SecretError as exc:
            entry.report(str(exc))
            continue
        if not key:
            entry.report("must have a non-empty key")
            continue
        entries.append((key, entry))
    return entries


def _latency_target(node: _Node) -> LatencyTarget:
    """An objective's ``ttft_ms`` / ``tpot_ms`` (milliseconds > 0; absent: no target)."""
    ttft, tpot = (
        None if node.at(key).value is None else node.real(key, 1.0) / 1000
        for key in ("ttft_ms", "tpot_ms")
    )
    return LatencyTarget(ttft, tpot)


def _admission(node: _Node, scrape_interval: float) -> SaturationDetector:
    node.only(
        "mode",
        "queue_threshold",
        "kv_threshold",
        "stale_seconds",
        "max_requests",
        "max_tokens",
        "sheddable_reserve",
        "pool_reserve",
        "capacity",
        "ttl",
        "bands",
        "scope",
    )
    # Metrics are stale after a few missed scrapes, whatever the interval.
    d = SaturationDetector(stale_seconds=max(DEFAULT_STALE_SECONDS, 4 * scrape_interval))
    kv = node.real("kv_threshold", d.kv_threshold)
    if kv > 1:
        node.at("kv_threshold").report(f"must be a fraction in (0, 1], got {kv!r}")
        kv = d.kv_threshold
    max_requests = node.integer("max_requests", d.max_requests, ge=0)
    pool_reserve = node.integer("pool_reserve", d.pool_reserve, ge=0)
    if pool_reserve and not max_requests:
        # The reserve is counted in request slots: without a request limit there are none.
        node.at("pool_reserve").report("needs admission.max_requests > 0 (it counts request slots)")
        pool_reserve = d.pool_reserve
    return SaturationDetector(
        queue_threshold=node.integer("queue_threshold", d.queue_threshold, ge=1),
        kv_threshold=kv,
        stale_seconds=node.real("stale_seconds", d.stale_seconds),
        max_requests=max_requests,
        max_tokens=node.integer("max_tokens", d.max_tokens, ge=0),
        sheddable_reserve=_fraction(node, "sheddable_reserve", d.sheddable_reserve),
        pool_reserve=pool_reserve,
    )


def _autoscaling(node: _Node) -> DemandPolicy:
    node.only("target_utilisation", "replica_concurrency", "window_seconds")
    d = DemandPolicy()
    target = node.real("target_utilisation", d.target_utilisation)
    if not 0 < target <= 1:
        node.at("target_utilisation").report(f"must be a fraction in (0, 1], got {target!r}")
        target = d.target_utilisation
    window = node.real("window_seconds", d.window_seconds)
    if window <= 0:
        node.at("window_seconds").report(f"must be positive, got {window!r}")
        window = d.window_seconds
    return DemandPolicy(
        target_utilisation=target,
        replica_concurrency=node.integer("replica_concurrency", d.replica_concurrency, ge=1),
        window_seconds=window,
    )


def _fraction(node: _Node, key: str, default: float) -> float:
    value = node.real(key, default, ge=0.0)
    if value >= 1:
        node.at(key).report(f"must be a fraction in [0, 1), got {value!r}")
        return default
    return value


def _spillover(root: _Node, pools: Mapping[str, tuple[str, ...]]) -> Spillover:
    """The ``overflow`` section, and each pool's ``overflow`` list naming its entries."""
    overflow: dict[str, OverflowPool] = {}
    home = {a for addrs in pools.values() for a in addrs}
    for name, node in root.child("overflow").items():
        node.only("gateway", "endpoints", "max_requests")
        if name in pools:
            node.report(f"must not share a name with pool {name!r}")
        addresses: dict[str, list[str]] = {}
        for key in ("gateway", "endpoints"):
            listed = node.child(key, required=True)
            if listed.value == []:
                listed.report("must list at least one host:port")
            addresses[key] = [a for a in map(_host_port, listed.list()) if a is not None]
        for index, addr in enumerate(addresses["endpoints"]):
            if addr in home:
                node.at("endpoints").at(index).report(
                    f"must not be an endpoint of a home pool, got {addr}"
                )
        overflow[name] = OverflowPool(
            tuple(addresses["gateway"]),
            tuple(addresses["endpoints"]),
            node.integer("max_requests", 0, ge=0),
        )
    routes: dict[str, tuple[str, ...]] = {}
    for pool, node in root.child("pools").items():
        if not isinstance(node.value, dict) or node.at("overflow").value is None:
            continue
        refs = node.child("overflow")
        for ref in refs.list():
            if ref.value not in overflow:
                ref.report(f"must name an entry of the overflow section, got {ref.value!r}")
        routes[pool] = tuple(str(r.value) for r in refs.list() if r.value in overflow)
    return Spillover(overflow, routes)


def _host_port(node: _Node) -> str | None:
    """``host:port`` where host may be a name (another region's gateway is often one)."""
    value = node.value
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        node.report(f"must be 'host:port' with a port in 1..65535, got {value!r}")
        return None
    return str(value)


_MODES = ("off", "shed", "queue")
_SCOPES = ("group", "local")


def _flow_control(node: _Node) -> FlowControl:
    d = FlowControl()
    mode = node.get("mode", str, d.mode)
    if mode not in _MODES:
        node.at("mode").report(f"must be one of {', '.join(_MODES)}, got {mode!r}")
        mode = d.mode
    default = BandLimits(
        node.integer("capacity", d.limits.default.capacity, ge=1),
        node.real("ttl", d.limits.default.ttl),
    )
    bands: dict[int, BandLimits] = {}
    for key, band in node.child("bands").items():
        try:
            priority = int(key)
        except ValueError:
            band.report("must be keyed by an integer priority")
            continue
        band.only("capacity", "ttl")
        bands[priority] = BandLimits(
            band.integer("capacity", default.capacity, ge=1), band.real("ttl", default.ttl)
        )
    # The whole queue holds as much as its bands together (at least llm-d's 5,000).
    total = max(d.limits.capacity, default.capacity, sum(b.capacity for b in bands.values()))
    scope = node.get("scope", str, d.scope)
    if scope not in _SCOPES:
        node.at("scope").report(f"must be one of {', '.join(_SCOPES)}, got {scope!r}")
        scope = d.scope
    return FlowControl(
        cast(AdmissionMode, mode),
        QueueLimits(total, default, bands),
        cast(AdmissionScope, scope),
    )


def _budgets(node: _Node) -> BudgetPolicy:
    node.only("tenants", "default", "window_seconds")
    d = BudgetPolicy()
    return BudgetPolicy(
        tenants={name: _limits(entry) for name, entry in node.child("tenants").items()},
        default=_limits(node.child("default")),
        window_seconds=node.real("window_seconds", d.window_seconds),
    )


def _limits(node: _Node) -> Limits:
    """``{rpm, tpm}``: requests and tokens per window, 0 or absent for no limit."""
    node.only("rpm", "tpm")
    return Limits(node.integer("rpm", 0, ge=0), node.integer("tpm", 0, ge=0))


def _store(node: _Node) -> StoreConfig:
    secrets = ("redis_url", "redis_username", "redis_password")
    node.only("backend", "key_prefix", *secrets, *(f"{key}_file" for key in secrets))
    d = StoreConfig()
    backend = node.get("backend", str, d.backend)
    if backend not in ("memory", "redis"):
        node.at("backend").report(f"must be 'memory' or 'redis', got {backend!r}")
    url = node.secret("redis_url") or d.redis_url
    username = node.secret("redis_username")
    password = node.secret("redis_password")
    if not url.startswith(REDIS_SCHEMES):  # standalone, Sentinel or Cluster: see epp.state.shared
        # Not the URL itself: it may carry a password.
        node.at("redis_url").report(f"must start with one of {', '.join(REDIS_SCHEMES)}")
    elif password and has_password(url):
        node.at("redis_password").report("must not be set when redis_url carries a password")
    elif password:
        url = with_credentials(url, username, password)
    given = any(node.at(key).value is not None for key in ("redis_password", "redis_password_file"))
    if username and not given:
        node.at("redis_username").report("needs redis_password (Redis authenticates both)")
    return StoreConfig(backend, url, node.get("key_prefix", str, d.key_prefix), username, password)


def _health(node: _Node) -> HealthConfig:
    node.only(*(f.name for f in dataclasses.fields(HealthConfig)))
    d = HealthConfig()
    error_rate = node.real("error_rate", d.error_rate)
    if error_rate > 1:
        node.at("error_rate").report(f"must be a fraction in (0, 1], got {error_rate!r}")
        error_rate = d.error_rate
    share = node.real("max_ejection_percent", d.max_ejection_percent, ge=0)
    if share > 100:
        node.at("max_ejection_percent").report(f"must be a percentage in [0, 100], got {share!r}")
        share = d.max_ejection_percent
    base = node.real("base_ejection_seconds", d.base_ejection_seconds)
    longest = node.real("max_ejection_seconds", d.max_ejection_seconds)
    if longest < base:
        node.at("max_ejection_seconds").report(
            f"must be >= base_ejection_seconds ({base:g}), got {longest!r}"
        )
        longest = base
    rule = node.get("latency_rule", str, d.latency_rule)
    if rule not in LATENCY_RULES:
        node.at("latency_rule").report(f"must be one of {', '.join(LATENCY_RULES)}, got {rule!r}")
        rule = d.latency_rule
    return HealthConfig(
        enabled=node.get("enabled", bool, d.enabled),
        consecutive_failures=node.integer("consecutive_failures", d.consecutive_failures, ge=1),
        error_rate=error_rate,
        window_seconds=node.real("window_seconds", d.window_seconds),
        min_requests=node.integer("min_requests", d.min_requests, ge=1),
        latency_factor=node.real("latency_factor", d.latency_factor, ge=1),
        latency_floor_seconds=node.real("latency_floor_seconds", d.latency_floor_seconds, ge=0),
        latency_samples=node.integer("latency_samples", d.latency_samples, ge=1),
        latency_prompt_tokens=node.integer("latency_prompt_tokens", d.latency_prompt_tokens, ge=0),
        latency_rule=rule,
        base_ejection_seconds=base,
        max_ejection_seconds=longest,
        max_ejection_percent=share,
        trial_successes=node.integer("trial_successes", d.trial_successes, ge=1),
        trial_interval_seconds=node.real("trial_interval_seconds", d.trial_interval_seconds, ge=0),
        trial_timeout_seconds=node.real("trial_timeout_seconds", d.trial_timeout_seconds),
    )


def _tracing(node: _Node) -> TracingConfig:
    node.only("endpoint", "sample_ratio", "service_name")
    d = TracingConfig()
    endpoint = node.get("endpoint", str, d.endpoint)
    if endpoint and not endpoint.startswith(("http://", "https://")):
        node.at("endpoint").report(
            f"must be the collector's OTLP/HTTP traces URL (http://host:4318/v1/traces), "
            f"got {endpoint!r}"
        )
        endpoint = d.endpoint
    ratio = node.real("sample_ratio", d.sample_ratio, ge=0)
    if ratio > 1:
        node.at("sample_ratio").report(f"must be a fraction in [0, 1], got {ratio!r}")
        ratio = d.sample_ratio
    service = node.get("service_name", str, d.service_name)
    if not service:
        node.at("service_name").report("must not be empty")
        service = d.service_name
    return TracingConfig(endpoint, ratio, service)


def _scheduling(node: _Node) -> SchedulingConfig:
    node.only("profile", "plugins", "profiles")
    declared = _declared_plugins(node.child("plugins"))
    profiles: dict[str, ProfileSpec] = {}
    section = node.child("profiles")
    for name, entries in section.items():
        profiles[name] = _profile(name, entries, declared)
    if "default" not in profiles:
        builtin = _Node(DEFAULT_PROFILE, f"{section.path}.default", node.source, node.errors)
        profiles["default"] = _profile("default", builtin, declared)
    for name, message in decider_problems(profiles):
        section.at(name).report(message)
    wanted = node.get("profile", str, "default")
    if wanted not in profiles:
        node.at("profile").report(
            f"must name a profile under scheduling.profiles, got {wanted!r} "
            f"(profiles: {', '.join(profiles)})"
        )
        wanted = "default"
    return SchedulingConfig(wanted, profiles)


def _declared_plugins(node: _Node) -> dict[str, PluginSpec | None]:
    """``scheduling.plugins``: named plugin instances with parameters, checked even when no
    profile uses them (None: declared, but already reported as bad)."""
    declared: dict[str, PluginSpec | None] = {}
    for item in node.list():
        item.only("name", "type", "parameters")
        type_name = item.get("type", str, "")
        if not type_name:
            item.at("type").report("must be set to a plugin type")
            continue
        name = item.get("name", str, type_name)
        if name in declared:
            item.at("name").report(f"must be unique, got {name!r} twice")
        declared[name] = _plugin_spec(type_name, name, item.child("parameters"), item.at("type"))
    return declared


def _plugin_spec(type_name: str, name: str, params: _Node, where: _Node) -> PluginSpec | None:
    cls = plugin_class(type_name)
    if cls is None:
        where.report(
            f"must be a plugin type, got {type_name!r} (types: {', '.join(plugin_types())})"
        )
        return None
    values, problems = parse_params(cls.params_type, params.mapping())
    for key, message in problems:
        params.at(key).report(message)
    if values is None:
        return None
    return PluginSpec(type_name, name, values)


def _profile(name: str, node: _Node, declared: Mapping[str, PluginSpec | None]) -> ProfileSpec:
    specs: list[PluginSpec] = []
    positions: list[int] = []
    if node.value is not None and not isinstance(node.value, list):
        node.list()  # reports the wrong type; nothing else to check
        return ProfileSpec(name, ())
    entries = node.list()
    for i, entry in enumerate(entries):
        entry.only("plugin", "pluginRef", "weight", "parameters")
        ref = entry.get("plugin", str, "") or entry.get("pluginRef", str, "")
        if not ref:
            entry.at("plugin").report("must name a plugin")
            continue
        weight = entry.optional_real("weight")
        parameters = entry.child("parameters")
        if ref in declared:
            spec = declared[ref]
            if parameters.value is not None:
                parameters.report(f"must be given under scheduling.plugins, where '{ref}' is")
        else:
            spec = _plugin_spec(ref, ref, parameters, entry.at("plugin"))
        if spec is None:
            continue
        specs.append(PluginSpec(spec.type_name, spec.name, spec.params, weight))
        positions.append(i)
    complete = len(specs) == len(entries)
    classes = [(plugin_class(s.type_name), s.name, s.weight) for s in specs]
    for problem in profile_problems([(c, n, w) for c, n, w in classes if c is not None]):
        # With an entry already reported, what the profile lacks (a picker, a producer) may be
        # that entry: only the other entries' own problems are worth reporting.
        if complete or problem.key is not None:
            at = node if problem.entry is None else entries[positions[problem.entry]]
            (at.at(problem.key) if problem.key else at).report(problem.message)
    return ProfileSpec(name, tuple(specs))
