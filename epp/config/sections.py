"""The flat sections: server, scrape, routing, store, autoscaling, budgets, edge, health,
tracing. Where the code reads a section through a class of its own package (``HealthConfig``,
``EdgeLimits``...), the section here declares the keys and :func:`domain` builds that class from
them; its defaults are read from that class, so each is written once."""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from epp.admission.budgets import BudgetPolicy, Limits
from epp.config.schema import Reload, knob, section
from epp.config.walker import Node, deferred, read_section
from epp.edge import EdgeLimits
from epp.metrics.demand import DemandPolicy
from epp.state.health import LATENCY_RULES, HealthConfig
from epp.state.shared.connect import SCHEMES as REDIS_SCHEMES
from epp.state.shared.connect import has_password, with_credentials
from epp.tls import ServerTls, server_tls_problems
from epp.tracing import TracingConfig

D = TypeVar("D")

DEBUG_ACCESS = ("local", "loopback", "any")
LOG_LEVELS = ("debug", "info", "warning", "error")


def domain(cls: type[D], source: Any) -> D:
    """``cls`` built from the same-named fields of section ``source``."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return cls(**{name: getattr(source, name) for name in names})


@section("TLS on all three listeners; with client_ca, mutual TLS", Reload.RESTART)
@dataclass(frozen=True, slots=True)
class ServerTlsSection:
    cert: str = knob("", doc="PEM certificate file (TLS needs a certificate and its key)")
    key: str = knob("", doc="its PEM key file")
    client_ca: str | None = knob(None, doc="PEM CA file the clients' certificates chain to")


def _server_tls(node: Node) -> ServerTls | None:
    given = read_section(ServerTlsSection, node)
    for name in ("cert", "key"):
        if not getattr(given, name):
            node.at(name).report("must be set to a PEM file (TLS needs a certificate and its key)")
    if not given.cert or not given.key:
        return None
    tls = ServerTls(given.cert, given.key, given.client_ca or None)
    for name, problem in server_tls_problems(tls):
        node.at(name).report(problem)
    return tls


@section("listening sockets, logging and shutdown timing", Reload.RESTART)
@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = knob("0.0.0.0", doc="address the three servers listen on (docs/security.md)")
    extproc_port: int = knob(9002, doc="ext_proc gRPC, for Envoy", ge=1, le=65535)
    health_port: int = knob(9003, doc="gRPC health: liveness, readiness", ge=1, le=65535)
    metrics_port: int = knob(9090, doc="Prometheus /metrics and /debug/*", ge=1, le=65535)
    log_level: str = knob(
        "info", choices=LOG_LEVELS, ignore_case=True, doc="debug logs every candidate's scores"
    )
    drain_seconds: float = knob(
        3.0, ge=0, doc="on SIGTERM: NOT_SERVING this long, so Envoy moves to another epp"
    )
    shutdown_grace_seconds: float = knob(
        30.0, ge=0, doc="then this long for open streams (long generations) to finish"
    )
    tls: ServerTls | None = knob(
        None, read=_server_tls, entries=ServerTlsSection, doc="TLS (PEM files); unset: plaintext"
    )
    debug_access: str = knob(
        "local",
        choices=DEBUG_ACCESS,
        doc="who may read /debug/*: local = loopback callers while no debug_token is set, "
        "then token holders only; loopback = loopback always and token holders; any = all",
    )
    debug_token: str = knob(
        "", secret=True, doc='callers sending "Authorization: Bearer TOKEN"; guards x-epp-scores'
    )
    max_buffered_bytes: int = knob(
        256 * 1024 * 1024,
        ge=0,
        doc="request-body bytes held at once (read or queued); beyond: 503 buffer_full; 0: no cap",
    )

    def checked(self, node: Node) -> ServerConfig:
        node.errors.extend(server_problems(self, node.source))
        return self


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


@section("vLLM /metrics polling; the interval also paces the shared-state sync")
@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    interval: float = knob(0.05, gt=0, doc="seconds between scrapes of each replica")
    timeout: float = knob(1.0, gt=0, doc="seconds a scrape may take")
    failure_threshold: int = knob(3, ge=1, doc="failures in a row before a replica is unready")


@section("how a request is answered")
@dataclass(frozen=True, slots=True)
class RoutingConfig:
    fallbacks: int = knob(1, ge=0, doc="extra endpoints in the answer, tried in order on retry")
    max_body_bytes: int = knob(16 * 1024 * 1024, ge=1, doc="largest request body epp reads")
    explain: bool = knob(False, doc="send every candidate's scores in x-epp-scores")
    explain_token: str = knob(
        "", secret=True, doc='set: scores only for requests with "x-epp-explain: TOKEN"'
    )
    inject_stream_usage: bool = knob(
        False, doc="ask for usage on streams that did not; remove it from what they receive"
    )
    learned_capacity: bool = knob(
        False,
        doc="endpoints without a pool weight get the capacity learned from their responses "
        "(docs/learned-latency.md)",
    )
    passthrough: Mapping[str, str] = knob(
        factory=dict,
        read=deferred,
        shape="{PATH_PREFIX: POOL}",
        doc="non-inference paths (e.g. /tokenize) routed to a pool's least loaded replica, "
        "body unread; other unknown paths are a 404",
    )

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


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@section("the state store; redis: several epp processes share state", Reload.RESTART)
@dataclass(frozen=True, slots=True)
class StoreConfig:
    backend: Literal["memory", "redis"] = knob("memory", doc="memory, or redis to share state")
    # What epp connects with, redis_username and redis_password merged in: a secret.
    redis_url: str = knob(
        DEFAULT_REDIS_URL, secret=True, doc="redis://, rediss:// (TLS), Sentinel or Cluster URL"
    )
    key_prefix: str = knob("epp", doc="prefix of every key epp writes")
    # Kept apart as well, so a URL given on the command line gets them too.
    redis_username: str = knob("", secret=True, doc="an ACL user (needs redis_password)")
    redis_password: str = knob("", secret=True, doc="merged into redis_url")

    def with_url(self, url: str) -> StoreConfig:
        """The Redis store at ``url`` (``epp serve --redis-url``), with the configured
        credentials unless ``url`` carries a password of its own."""
        if self.redis_password and not has_password(url):
            url = with_credentials(url, self.redis_username, self.redis_password)
        return dataclasses.replace(self, backend="redis", redis_url=url)

    def checked(self, node: Node) -> StoreConfig:
        url = self.redis_url or DEFAULT_REDIS_URL
        if not url.startswith(REDIS_SCHEMES):  # standalone, Sentinel or Cluster
            # Not the URL itself: it may carry a password.
            node.at("redis_url").report(f"must start with one of {', '.join(REDIS_SCHEMES)}")
        elif self.redis_password and has_password(url):
            node.at("redis_password").report("must not be set when redis_url carries a password")
        elif self.redis_password:
            url = with_credentials(url, self.redis_username, self.redis_password)
        given = any(node.at(k).value is not None for k in ("redis_password", "redis_password_file"))
        if self.redis_username and not given:
            node.at("redis_username").report("needs redis_password (Redis authenticates both)")
        return dataclasses.replace(self, redis_url=url)


_DEMAND = DemandPolicy()


@section("epp_pool_desired_replicas (docs/autoscaling.md)")
@dataclass(frozen=True, slots=True)
class AutoscalingSection:
    target_utilisation: float = knob(
        _DEMAND.target_utilisation,
        gt=0,
        le=1,
        noun="fraction",
        doc="share of a replica's concurrency to plan for",
    )
    replica_concurrency: int = knob(
        _DEMAND.replica_concurrency, ge=1, doc="requests one replica runs at once at full speed"
    )
    window_seconds: float = knob(
        _DEMAND.window_seconds, gt=0, doc="smoothing of the arrival and service rates"
    )


@section("requests and tokens per window, 0 for no limit")
@dataclass(frozen=True, slots=True)
class LimitsSection:
    rpm: int = knob(0, ge=0, doc="requests per window")
    tpm: int = knob(0, ge=0, doc="prompt + output tokens per window")


@section("per-tenant (fairness id) budgets (docs/admission.md#tenant-budgets)")
@dataclass(frozen=True, slots=True)
class BudgetsSection:
    tenants: Mapping[str, LimitsSection] = knob(factory=dict, doc="fairness id -> its limits")
    default: LimitsSection = knob(factory=LimitsSection, doc="every other tenant")
    window_seconds: float = knob(
        BudgetPolicy().window_seconds, gt=0, doc="the budgets' window; a change starts afresh"
    )

    def policy(self) -> BudgetPolicy:
        return BudgetPolicy(
            tenants={name: domain(Limits, limits) for name, limits in self.tenants.items()},
            default=domain(Limits, self.default),
            window_seconds=self.window_seconds,
        )


_EDGE = EdgeLimits()


@section("the limits `epp envoy-config` renders into Envoy (docs/deploy.md#edge-limits)")
@dataclass(frozen=True, slots=True)
class EdgeSection:
    max_requests: int = knob(
        _EDGE.max_requests, ge=1, doc="in flight per cluster (the pool, each overflow, epp)"
    )
    max_pending_requests: int = knob(
        _EDGE.max_pending_requests, ge=1, doc="waiting for a connection, per cluster"
    )
    max_retries: int = knob(_EDGE.max_retries, ge=1, doc="retries under way at once, per cluster")
    max_connections: int = knob(
        _EDGE.max_connections, ge=1, doc="client connections, the whole Envoy"
    )
    # Below this Envoy's own heap at rest would be near the limit.
    max_heap_bytes: int = knob(
        _EDGE.max_heap_bytes,
        ge=64 * 1024**2,
        doc="Envoy's heap; past 90% it frees memory, past 95% new requests are 503",
    )
    request_timeout_s: float = knob(
        _EDGE.request_timeout_s,
        ge=0,
        doc="to receive a whole request, on top of the time epp may hold it (0: none)",
    )
    request_headers_timeout_s: float = knob(
        _EDGE.request_headers_timeout_s, ge=0, doc="to receive a request's headers"
    )
    stream_idle_timeout_s: float = knob(
        _EDGE.stream_idle_timeout_s, ge=0, doc="no bytes either way for this long: reset (0: never)"
    )
    connection_buffer_bytes: int = knob(
        _EDGE.connection_buffer_bytes,
        ge=1024,
        doc="buffered per connection, client side and replica side",
    )


_HEALTH = HealthConfig()


@section("passive health from real responses (docs/health.md)")
@dataclass(frozen=True, slots=True)
class HealthSection:
    enabled: bool = knob(_HEALTH.enabled, doc="false: every circuit closes")
    consecutive_failures: int = knob(
        _HEALTH.consecutive_failures, ge=1, doc="failures in a row (5xx, incomplete) that eject"
    )
    error_rate: float = knob(
        _HEALTH.error_rate, gt=0, le=1, noun="fraction", doc="or this failure share over the window"
    )
    window_seconds: float = knob(_HEALTH.window_seconds, gt=0, doc="the error-rate window")
    min_requests: int = knob(
        _HEALTH.min_requests, ge=1, doc="answers the window holds before its rate counts"
    )
    latency_rule: str = knob(
        _HEALTH.latency_rule,
        choices=LATENCY_RULES,
        doc="streamed TTFTs against the latency model's prediction (residual), the pool's, or off",
    )
    latency_factor: float = knob(
        _HEALTH.latency_factor,
        ge=1,
        doc="median of TTFT / prediction, or of latency / the pool's others', above this ejects",
    )
    latency_floor_seconds: float = knob(
        _HEALTH.latency_floor_seconds,
        ge=0,
        doc="predictions count as at least this; pool latencies must also exceed it",
    )
    latency_samples: int = knob(
        _HEALTH.latency_samples, ge=1, doc="over the last this many samples (within the window)"
    )
    latency_prompt_tokens: int = knob(
        _HEALTH.latency_prompt_tokens,
        ge=0,
        doc="pool rule: a streamed TTFT counts per this many prefill tokens ahead (0: as measured)",
    )
    base_ejection_seconds: float = knob(
        _HEALTH.base_ejection_seconds, gt=0, doc="the n-th ejection in a row lasts base x 2^(n-1)"
    )
    max_ejection_seconds: float = knob(
        _HEALTH.max_ejection_seconds, gt=0, doc="at most this (>= base_ejection_seconds)"
    )
    max_ejection_percent: float = knob(
        _HEALTH.max_ejection_percent,
        ge=0,
        le=100,
        noun="percentage",
        doc="never more of a pool ejected at once (never its last endpoint)",
    )
    trial_successes: int = knob(
        _HEALTH.trial_successes, ge=1, doc="half-open trials that must succeed to close"
    )
    trial_interval_seconds: float = knob(
        _HEALTH.trial_interval_seconds, ge=0, doc="at most one trial starts per interval"
    )
    trial_timeout_seconds: float = knob(
        _HEALTH.trial_timeout_seconds, gt=0, doc="a trial never answered is given up after this"
    )

    def checked(self, node: Node) -> HealthSection:
        if self.max_ejection_seconds < self.base_ejection_seconds:
            node.at("max_ejection_seconds").report(
                f"must be >= base_ejection_seconds ({self.base_ejection_seconds:g}), "
                f"got {self.max_ejection_seconds!r}"
            )
            return dataclasses.replace(self, max_ejection_seconds=self.base_ejection_seconds)
        return self


_TRACING = TracingConfig()


@section("OpenTelemetry spans of each decision (docs/tracing.md)", Reload.RESTART)
@dataclass(frozen=True, slots=True)
class TracingSection:
    endpoint: str = knob(
        _TRACING.endpoint,
        doc="the collector's OTLP/HTTP URL, http://HOST:4318/v1/traces; empty: off",
    )
    sample_ratio: float = knob(
        _TRACING.sample_ratio,
        ge=0,
        le=1,
        noun="fraction",
        doc="share of requests traced (a request's own traceparent decides first)",
    )
    service_name: str = knob(_TRACING.service_name, doc="the spans' service.name")

    def checked(self, node: Node) -> TracingSection:
        endpoint, service = self.endpoint, self.service_name
        if endpoint and not endpoint.startswith(("http://", "https://")):
            node.at("endpoint").report(
                f"must be the collector's OTLP/HTTP traces URL (http://host:4318/v1/traces), "
                f"got {endpoint!r}"
            )
            endpoint = _TRACING.endpoint
        if not service:
            node.at("service_name").report("must not be empty")
            service = _TRACING.service_name
        return TracingSection(endpoint, self.sample_ratio, service)
