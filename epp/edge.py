"""What the Envoy in front of epp enforces before a request reaches epp (``epp envoy-config``).

Two settings live here, as plain data that :mod:`epp.config` validates and
:mod:`epp.envoy_config` renders:

* :class:`Authentication`: who may name a request's tenant and objective at the edge. Envoy
  strips every client copy of the identity headers first, then an authenticating filter sets
  them: ``jwt_authn`` from a token's claims (keys from a local JWKS file), or an external
  authorization service (``ext_authz``) that answers with the headers (docs/identity.md).
* :class:`EdgeLimits`: bounds on what one client can make Envoy hold: connections and requests
  per cluster, heap, timeouts, buffers (docs/deploy.md, edge limits).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JwtAuth:
    """Envoy's ``jwt_authn``: a bearer token signed by a key in ``jwks_file`` (read by Envoy at
    start), issued by ``issuer`` for one of ``audiences`` (any when empty), not expired. Its
    ``tenant_claim`` becomes the fairness id and its ``objective_claim`` the objective.
    ``required``: a request without a token is refused (401) rather than given the defaults;
    a token that fails verification is refused either way."""

    jwks_file: str
    issuer: str
    audiences: tuple[str, ...] = ()
    tenant_claim: str = "tenant"
    objective_claim: str = "objective"
    required: bool = False


@dataclass(frozen=True, slots=True)
class AuthService:
    """An HTTP external authorization service (Envoy ``ext_authz``) at ``address`` (host:port).
    Envoy asks it about every request, passing the ``authorization`` header; a 2xx answer lets
    the request through with the answer's ``headers`` (identity headers, by name) set on it,
    anything else is returned to the client. No answer within ``timeout_ms``: 403."""

    address: str
    headers: tuple[str, ...]
    timeout_ms: int = 250


@dataclass(frozen=True, slots=True)
class Authentication:
    """The authenticating filters the rendered Envoy runs after stripping client copies of the
    identity headers (none by default)."""

    jwt: JwtAuth | None = None
    service: AuthService | None = None

    def headers_set(self, tenant_header: str, objective_header: str) -> frozenset[str]:
        """The headers these filters set, which epp may therefore trust."""
        out: set[str] = set()
        if self.jwt is not None:
            out |= {tenant_header, objective_header}
        if self.service is not None:
            out |= set(self.service.headers)
        return frozenset(out)


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """Bounds the rendered Envoy puts on what clients can make it hold.

    Per cluster (the pool, each overflow gateway, epp): ``max_requests`` in flight (each LLM
    request holds one on the pool and one ext_proc stream on epp for its whole life, so this is
    the fleet-wide concurrency Envoy allows; epp's admission control decides below it),
    ``max_pending_requests`` waiting for a connection, ``max_retries`` at once.
    ``max_connections``: downstream connections for the whole process. ``max_heap_bytes``: the
    heap Envoy may use; past 90% it releases free memory, past 95% it answers new requests 503.
    ``request_timeout_s``: to receive a whole request, on top of the time epp may hold it
    (0: none). ``request_headers_timeout_s``: to receive its headers. ``stream_idle_timeout_s``:
    a stream with no bytes either way for this long is reset (a non-streamed generation longer
    than this is cut; 0: none). ``connection_buffer_bytes``: what Envoy buffers per connection
    (request bodies epp reads are buffered per stream, up to ``routing.max_body_bytes``).
    """

    max_requests: int = 10_000
    max_pending_requests: int = 1_000
    max_retries: int = 1_000
    max_connections: int = 50_000
    max_heap_bytes: int = 2 * 1024**3
    request_timeout_s: float = 60.0
    request_headers_timeout_s: float = 10.0
    stream_idle_timeout_s: float = 900.0
    connection_buffer_bytes: int = 32 * 1024
