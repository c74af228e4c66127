"""The one YAML file that configures epp, validated up front with errors naming the bad key.

Shape (every section optional except ``models`` and ``pools``)::

    models:   {NAME: {pools: [POOL, ...], lora: bool, tokenizer: DIR}}
    pools:    {POOL: {endpoints: [host:port | {address, weight, kv_events}, ...]}}
    server:   {host, extproc_port, health_port, metrics_port, log_level}
    scrape:   {interval, timeout, failure_threshold}
    routing:  {fallbacks, max_body_bytes, explain}
    request:  {session_header, priority_header, objective_header, objectives: {NAME: int}}
    admission: {queue_threshold, kv_threshold, stale_seconds}
    scheduling: {profile, plugins: [{name, type, parameters}], profiles: {NAME: [{plugin, weight}]}}
    store:    {backend: memory|redis, redis_url, key_prefix}

A :class:`Config` is immutable; reloading builds a new one and swaps it in, so requests in
flight finish with the configuration they started with.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from epp.admission import SaturationDetector
from epp.admission.saturation import DEFAULT_STALE_SECONDS
from epp.request import RequestPolicy
from epp.scheduling import (
    Filter,
    Picker,
    PostPick,
    Prepare,
    Profile,
    Scorer,
    create_plugin,
    plugin_types,
)
from epp.scheduling.framework import Plugin
from epp.state.shared.connect import SCHEMES as REDIS_SCHEMES


class ConfigError(ValueError):
    """A configuration problem; the message starts with the dotted path of the bad key."""


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
    {"plugin": "ttft-scorer", "weight": 2},
    {"plugin": "max-score-picker"},
]


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


@dataclass(frozen=True, slots=True)
class StoreConfig:
    backend: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "epp"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A model name clients send, the pools that serve it, and how to read its prompts."""

    pools: tuple[str, ...]
    # The name is a LoRA adapter loaded on the pools' replicas (vLLM --lora-modules NAME=...).
    lora: bool = False
    # Local Hugging Face tokenizer directory, for scorers that need the engine's token ids.
    tokenizer: str | None = None


@dataclass(frozen=True, slots=True)
class Config:
    models: Mapping[str, ModelConfig]
    pools: Mapping[str, tuple[str, ...]]
    profile: Profile
    server: ServerConfig = field(default_factory=ServerConfig)
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    request: RequestPolicy = field(default_factory=RequestPolicy)
    admission: SaturationDetector = field(default_factory=SaturationDetector)
    store: StoreConfig = field(default_factory=StoreConfig)
    # Relative capacity of endpoints (default 1.0): a replica of weight 2 takes twice the work.
    weights: Mapping[str, float] = field(default_factory=dict)
    # ZMQ address of each endpoint's vLLM KV-event publisher (tcp://host:port), where known.
    kv_events: Mapping[str, str] = field(default_factory=dict)
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
    """Read and validate a YAML file; raise :class:`ConfigError` naming the bad key."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read configuration file: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, source=str(path))


def parse_config(data: Any, source: str = "<config>") -> Config:
    root = _Node(data, "", source)
    root.only(
        "models",
        "pools",
        "server",
        "scrape",
        "routing",
        "request",
        "admission",
        "scheduling",
        "store",
    )
    pools = _pools(root.child("pools", required=True))
    scrape = _scrape(root.child("scrape"))
    models = _models(root.child("models", required=True), pools.endpoints)
    return Config(
        models=models,
        pools=pools.endpoints,
        profile=_scheduling(root.child("scheduling")),
        server=_server(root.child("server")),
        scrape=scrape,
        routing=_routing(root.child("routing")),
        request=_request(root.child("request")),
        admission=_admission(root.child("admission"), scrape.interval),
        store=_store(root.child("store")),
        weights=pools.weights,
        kv_events=pools.kv_events,
        source=source,
    )


class _Node:
    """A value in the YAML tree that knows its dotted path, for error messages."""

    def __init__(self, value: Any, path: str, source: str) -> None:
        self.value = value
        self.path = path
        self.source = source

    def error(self, message: str) -> ConfigError:
        where = self.path or "(top level)"
        return ConfigError(f"{self.source}: {where}: {message}")

    def mapping(self) -> Mapping[str, Any]:
        if self.value is None:
            return {}
        if not isinstance(self.value, dict):
            raise self.error(f"must be a mapping, got {type(self.value).__name__}")
        return self.value

    def only(self, *keys: str) -> None:
        for key in self.mapping():
            if key not in keys:
                raise self.at(str(key)).error(f"unknown key (expected one of: {', '.join(keys)})")

    def at(self, key: str | int) -> _Node:
        path = f"{self.path}[{key}]" if isinstance(key, int) else f"{self.path}.{key}".lstrip(".")
        value = self.value[key] if isinstance(key, int) else self.mapping().get(key)
        return _Node(value, path, self.source)

    def child(self, key: str, required: bool = False) -> _Node:
        node = self.at(key)
        if required and node.value is None:
            raise node.error("is required")
        return node

    def items(self) -> list[tuple[str, _Node]]:
        return [(str(k), self.at(k)) for k in self.mapping()]

    def list(self) -> list[_Node]:
        if self.value is None:
            return []
        if not isinstance(self.value, list):
            raise self.error(f"must be a list, got {type(self.value).__name__}")
        return [self.at(i) for i in range(len(self.value))]

    def get(self, key: str, kind: type, default: Any) -> Any:
        node = self.at(key)
        value = node.value
        if value is None:
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise node.error(f"must be {kind.__name__}, got {type(value).__name__} {value!r}")
        return value

    def positive(self, key: str, kind: type, default: Any, minimum: float = 0) -> Any:
        value = self.get(key, kind, default)
        if value < minimum or (minimum == 0 and value == 0 and kind is float):
            raise self.at(key).error(f"must be > {minimum}" if kind is float else f">= {minimum}")
        return value


def _address(node: _Node) -> str:
    value = node.value
    if not isinstance(value, str) or ":" not in value:
        raise node.error(f"must be 'host:port', got {value!r}")
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise node.error(f"must be 'host:port' with a port in 1..65535, got {value!r}")
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        # Envoy's override_host policy matches endpoints by IP address, not hostname.
        raise node.error(f"host must be an IP address (Envoy routes by IP), got {host!r}") from None
    return value


class _Pools(NamedTuple):
    endpoints: dict[str, tuple[str, ...]]
    weights: dict[str, float]
    kv_events: dict[str, str]


def _pools(node: _Node) -> _Pools:
    pools: dict[str, tuple[str, ...]] = {}
    weights: dict[str, float] = {}
    kv_events: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name, pool in node.items():
        pool.only("endpoints")
        endpoints = pool.child("endpoints", required=True).list()
        if not endpoints:
            raise pool.at("endpoints").error("must list at least one endpoint")
        addrs = []
        for ep in endpoints:
            if isinstance(ep.value, dict):
                ep.only("address", "weight", "kv_events")
                addr = _address(ep.child("address", required=True))
                weight = ep.positive("weight", float, 1.0)
                if weight != 1.0:
                    weights[addr] = weight
                events = ep.get("kv_events", str, None)
                if events is not None:
                    if not events.startswith(("tcp://", "ipc://")):
                        raise ep.at("kv_events").error("must be a tcp:// or ipc:// ZMQ address")
                    kv_events[addr] = events
            else:
                addr = _address(ep)
            if addr in seen:
                raise ep.error(f"{addr} is already an endpoint of pool '{seen[addr]}'")
            seen[addr] = name
            addrs.append(addr)
        pools[name] = tuple(addrs)
    if not pools:
        raise node.error("must define at least one pool")
    return _Pools(pools, weights, kv_events)


def _models(node: _Node, pools: Mapping[str, tuple[str, ...]]) -> dict[str, ModelConfig]:
    models: dict[str, ModelConfig] = {}
    for name, model in node.items():
        model.only("pools", "lora", "tokenizer")
        refs = model.child("pools", required=True).list()
        if not refs:
            raise model.at("pools").error("must name at least one pool")
        for ref in refs:
            if ref.value not in pools:
                raise ref.error(f"unknown pool {ref.value!r} (pools: {', '.join(pools)})")
        tokenizer = model.get("tokenizer", str, None)
        if tokenizer is not None and not (Path(tokenizer) / "tokenizer.json").is_file():
            raise model.at("tokenizer").error(f"no tokenizer.json in directory {tokenizer!r}")
        models[name] = ModelConfig(
            tuple(r.value for r in refs), model.get("lora", bool, False), tokenizer
        )
    if not models:
        raise node.error("must define at least one model")
    return models


def _server(node: _Node) -> ServerConfig:
    node.only(
        "host",
        "extproc_port",
        "health_port",
        "metrics_port",
        "log_level",
        "drain_seconds",
        "shutdown_grace_seconds",
    )
    d = ServerConfig()
    ports = {
        key: node.positive(key, int, getattr(d, key), minimum=0)
        for key in ("extproc_port", "health_port", "metrics_port")
    }
    level = node.get("log_level", str, d.log_level)
    if level.lower() not in ("debug", "info", "warning", "error"):
        raise node.at("log_level").error("must be one of debug, info, warning, error")
    drain = node.get("drain_seconds", float, d.drain_seconds)
    grace = node.get("shutdown_grace_seconds", float, d.shutdown_grace_seconds)
    if drain < 0 or grace < 0:
        raise node.error("drain_seconds and shutdown_grace_seconds must be >= 0")
    return ServerConfig(
        host=node.get("host", str, d.host),
        log_level=level,
        drain_seconds=drain,
        shutdown_grace_seconds=grace,
        **ports,
    )


def _scrape(node: _Node) -> ScrapeConfig:
    node.only("interval", "timeout", "failure_threshold")
    d = ScrapeConfig()
    return ScrapeConfig(
        interval=node.positive("interval", float, d.interval),
        timeout=node.positive("timeout", float, d.timeout),
        failure_threshold=node.positive("failure_threshold", int, d.failure_threshold, 1),
    )


def _routing(node: _Node) -> RoutingConfig:
    node.only("fallbacks", "max_body_bytes", "explain")
    d = RoutingConfig()
    return RoutingConfig(
        fallbacks=node.positive("fallbacks", int, d.fallbacks),
        max_body_bytes=node.positive("max_body_bytes", int, d.max_body_bytes, 1),
        explain=node.get("explain", bool, d.explain),
    )


def _request(node: _Node) -> RequestPolicy:
    node.only("session_header", "priority_header", "objective_header", "objectives")
    d = RequestPolicy()
    objectives: dict[str, int] = {}
    for name, value in node.child("objectives").items():
        if not isinstance(value.value, int) or isinstance(value.value, bool):
            raise value.error("must be an integer priority")
        objectives[name] = value.value
    return RequestPolicy(
        session_header=node.get("session_header", str, d.session_header).lower(),
        priority_header=node.get("priority_header", str, d.priority_header).lower(),
        objective_header=node.get("objective_header", str, d.objective_header).lower(),
        objectives=objectives,
    )


def _admission(node: _Node, scrape_interval: float) -> SaturationDetector:
    node.only("queue_threshold", "kv_threshold", "stale_seconds")
    # Metrics are stale after a few missed scrapes, whatever the interval.
    d = SaturationDetector(stale_seconds=max(DEFAULT_STALE_SECONDS, 4 * scrape_interval))
    kv = node.positive("kv_threshold", float, d.kv_threshold)
    if kv > 1:
        raise node.at("kv_threshold").error("must be a fraction in (0, 1]")
    return SaturationDetector(
        queue_threshold=node.positive("queue_threshold", int, d.queue_threshold, 1),
        kv_threshold=kv,
        stale_seconds=node.positive("stale_seconds", float, d.stale_seconds),
    )


def _store(node: _Node) -> StoreConfig:
    node.only("backend", "redis_url", "key_prefix")
    d = StoreConfig()
    backend = node.get("backend", str, d.backend)
    if backend not in ("memory", "redis"):
        raise node.at("backend").error(f"must be 'memory' or 'redis', got {backend!r}")
    url = node.get("redis_url", str, d.redis_url)
    if not url.startswith(REDIS_SCHEMES):  # standalone, Sentinel or Cluster: see epp.state.shared
        raise node.at("redis_url").error(f"must start with one of {', '.join(REDIS_SCHEMES)}")
    return StoreConfig(backend, url, node.get("key_prefix", str, d.key_prefix))


def _scheduling(node: _Node) -> Profile:
    node.only("profile", "plugins", "profiles")
    declared: dict[str, tuple[str, Mapping[str, Any], _Node]] = {}
    for item in node.child("plugins").list():
        item.only("name", "type", "parameters")
        type_name = item.get("type", str, None)
        if type_name is None:
            raise item.at("type").error("is required")
        name = item.get("name", str, type_name)
        declared[name] = (type_name, item.child("parameters").mapping(), item)
    profiles = node.child("profiles")
    wanted = node.get("profile", str, "default")
    entries = profiles.at(wanted)
    if entries.value is None:
        if profiles.value is not None and wanted != "default":
            raise node.at("profile").error(f"no profile named {wanted!r} under profiles")
        entries = _Node(DEFAULT_PROFILE, f"{profiles.path}.default", node.source)
    return _profile(wanted, entries, declared)


def _profile(
    name: str, node: _Node, declared: Mapping[str, tuple[str, Mapping[str, Any], _Node]]
) -> Profile:
    filters: list[Filter] = []
    scorers: list[tuple[Scorer, float]] = []
    pickers: list[Picker] = []
    for entry in node.list():
        entry.only("plugin", "pluginRef", "weight", "parameters")
        ref = entry.get("plugin", str, None) or entry.get("pluginRef", str, None)
        if ref is None:
            raise entry.at("plugin").error("is required")
        inline = (ref, entry.child("parameters").mapping(), entry)
        type_name, params, where = declared.get(ref, inline)
        try:
            plugin: Plugin = create_plugin(type_name, ref, params)
        except KeyError:
            raise where.error(
                f"unknown plugin type {type_name!r} (known: {', '.join(plugin_types())})"
            ) from None
        except ValueError as exc:
            raise where.error(str(exc)) from None
        weight = entry.get("weight", float, 1.0)
        if isinstance(plugin, Scorer):
            scorers.append((plugin, weight))
        elif isinstance(plugin, Filter):
            filters.append(plugin)
        elif isinstance(plugin, Picker):
            pickers.append(plugin)
    if len(pickers) != 1:
        raise node.error(f"a profile needs exactly one picker, found {len(pickers)}")
    plugins: list[Plugin] = [*filters, *(s for s, _ in scorers), *pickers]
    hooks = [p for p in plugins if isinstance(p, PostPick)]
    preparers = [p for p in plugins if isinstance(p, Prepare)]
    return Profile(name, filters, scorers, pickers[0], hooks, preparers)
