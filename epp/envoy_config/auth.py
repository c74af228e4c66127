"""Authentication in Envoy (``request.jwt``, ``request.auth_service``): the jwt_authn and
ext_authz filters that set the identity headers epp reads, and the authorization service's
cluster (docs/identity.md)."""

from __future__ import annotations

from typing import Any

from epp.config import Config
from epp.edge import AuthService, JwtAuth
from epp.envoy_config.common import (
    duration,
    is_ip,
    parse_address,
    socket_address,
    system_resolver,
    typed,
)
from epp.envoy_config.limits import circuit_breakers

JWT_PROVIDER = "epp"
AUTH_CLUSTER = "auth"


def authentication_filters(config: Config) -> list[dict[str, Any]]:
    """The filters that authenticate a request and set its identity headers, after the
    header_mutation filter stripped the client's copies and before ext_proc reads them."""
    auth = config.authentication
    out = []
    if auth.jwt is not None:
        out.append(_jwt_filter(auth.jwt, config))
    if auth.service is not None:
        out.append(_ext_authz_filter(auth.service))
    return out


def _jwt_filter(jwt: JwtAuth, config: Config) -> dict[str, Any]:
    """Envoy verifies the bearer token (signature against the local JWKS, issuer, audience,
    expiry) and copies the tenant and objective claims into epp's headers. A token that fails
    is refused with 401 whatever ``required`` says; only a request with none may pass, with
    the default identity. The token is not forwarded: replicas have no use for it."""
    policy = config.request
    provider: dict[str, Any] = {
        "issuer": jwt.issuer,
        "local_jwks": {"filename": jwt.jwks_file},
        "from_headers": [{"name": "authorization", "value_prefix": "Bearer "}],
        "forward": False,
        "claim_to_headers": [
            {"header_name": policy.fairness_header, "claim_name": jwt.tenant_claim},
            {"header_name": policy.objective_header, "claim_name": jwt.objective_claim},
        ],
    }
    if jwt.audiences:
        provider["audiences"] = list(jwt.audiences)
    requires: dict[str, Any] = {"provider_name": JWT_PROVIDER}
    if not jwt.required:
        requires = {"requires_any": {"requirements": [requires, {"allow_missing": {}}]}}
    return typed(
        "envoy.filters.http.jwt_authn",
        "envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
        providers={JWT_PROVIDER: provider},
        rules=[{"match": {"prefix": "/"}, "requires": requires}],
    )


def _ext_authz_filter(service: AuthService) -> dict[str, Any]:
    """Envoy asks the authorization service about each request (its headers, not its body);
    a 2xx answer's identity headers are set on the request, any other answer goes back to the
    client, and a service that cannot be reached refuses the request (403)."""
    return typed(
        "envoy.filters.http.ext_authz",
        "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
        http_service={
            "server_uri": {
                "uri": f"http://{service.address}",
                "cluster": AUTH_CLUSTER,
                "timeout": duration(service.timeout_ms),
            },
            "authorization_response": {
                "allowed_upstream_headers": {"patterns": [{"exact": h} for h in service.headers]}
            },
        },
        failure_mode_allow=False,
    )


def auth_clusters(config: Config) -> list[dict[str, Any]]:
    service = config.authentication.service
    if service is None:
        return []
    static = is_ip(parse_address(service.address)[0])
    return [
        {
            "name": AUTH_CLUSTER,
            "type": "STATIC" if static else "STRICT_DNS",
            **({} if static else system_resolver()),
            "connect_timeout": "1s",
            "circuit_breakers": circuit_breakers(config.edge),
            "lb_policy": "ROUND_ROBIN",
            "load_assignment": {
                "cluster_name": AUTH_CLUSTER,
                "endpoints": [
                    {"lb_endpoints": [{"endpoint": {"address": socket_address(service.address)}}]}
                ],
            },
        }
    ]
