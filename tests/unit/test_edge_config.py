"""The edge Envoy's identity and limits: what the configuration accepts, what it renders, and
that the real Envoy 1.40 binary accepts the result."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config import Config, ConfigError, parse_config
from epp.devstack import free_port
from epp.edge import EdgeLimits
from epp.envoy_config import render
from tests.helpers.envoy import EnvoyProcess, validate

FAIRNESS = "x-gateway-inference-fairness-id"
OBJECTIVE = "x-gateway-inference-objective"


def _config(**sections: Any) -> Config:
    return parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8000"]}},
            **sections,
        }
    )


def _boot(config: Config) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(render(config))
    return data


def _hcm(boot: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][
        0
    ]["typed_config"]
    return hcm


def _filter(boot: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(f for f in _hcm(boot)["http_filters"] if f["name"] == name)
    return found["typed_config"]


def _errors(**sections: Any) -> str:
    with pytest.raises(ConfigError) as info:
        _config(**sections)
    return str(info.value)


JWT = {"jwks_file": "/etc/epp/jwks.json", "issuer": "https://issuer.test", "audiences": ["epp"]}
AUTH = {"address": "auth.internal:9191", "headers": [FAIRNESS, "X-Priority"]}


def test_jwt_claims_become_the_trusted_identity_headers() -> None:
    config = _config(request={"jwt": {**JWT, "tenant_claim": "org", "objective_claim": "tier"}})
    assert config.request.authenticated_headers == {FAIRNESS, OBJECTIVE}
    assert not config.request.trusted_headers
    boot = _boot(config)
    names = [f["name"] for f in _hcm(boot)["http_filters"]]
    # Strip client copies, then set them from the verified token, then ask epp.
    assert names[:3] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.jwt_authn",
        "envoy.filters.http.ext_proc",
    ]
    jwt = _filter(boot, "envoy.filters.http.jwt_authn")
    (provider,) = jwt["providers"].values()
    assert provider["issuer"] == "https://issuer.test"
    assert provider["audiences"] == ["epp"]
    assert provider["local_jwks"] == {"filename": "/etc/epp/jwks.json"}
    assert provider["forward"] is False
    assert {(c["claim_name"], c["header_name"]) for c in provider["claim_to_headers"]} == {
        ("org", FAIRNESS),
        ("tier", OBJECTIVE),
    }
    # Optional by default: a request without a token passes with the default identity.
    (rule,) = jwt["rules"]
    assert {"allow_missing": {}} in rule["requires"]["requires_any"]["requirements"]
    required = _config(request={"jwt": {**JWT, "required": True}})
    (rule,) = _filter(_boot(required), "envoy.filters.http.jwt_authn")["rules"]
    assert rule["requires"] == {"provider_name": "epp"}


def test_an_authorization_service_sets_the_headers_it_is_allowed_to() -> None:
    config = _config(request={"auth_service": AUTH})
    assert config.request.authenticated_headers == {FAIRNESS, "x-priority"}
    boot = _boot(config)
    authz = _filter(boot, "envoy.filters.http.ext_authz")
    allowed = authz["http_service"]["authorization_response"]["allowed_upstream_headers"]
    assert [p["exact"] for p in allowed["patterns"]] == [FAIRNESS, "x-priority"]
    assert authz["failure_mode_allow"] is False
    cluster = next(c for c in boot["static_resources"]["clusters"] if c["name"] == "auth")
    assert cluster["type"] == "STRICT_DNS"  # a name, resolved by Envoy


@pytest.mark.parametrize(
    ("request_section", "needle"),
    [
        ({"jwt": {**JWT, "jwks_file": "jwks.json"}}, "request.jwt.jwks_file: must be an absolute"),
        ({"jwt": {"jwks_file": "/j.json"}}, "request.jwt.issuer: must be a non-empty"),
        ({"jwt": {**JWT, "audiences": [""]}}, "request.jwt.audiences[0]"),
        ({"jwt": {**JWT, "tenant_claim": ""}}, "request.jwt.tenant_claim"),
        ({"jwt": JWT, "trusted_headers": True}, "request.trusted_headers: must be false"),
        ({"jwt": JWT, "api_keys": {"k": {"tenant": "a"}}}, "request.api_keys: cannot be used"),
        ({"auth_service": {**AUTH, "headers": ["x-other"]}}, "request.auth_service.headers[0]"),
        ({"auth_service": {"headers": [FAIRNESS]}}, "request.auth_service.address: must be"),
        ({"auth_service": {**AUTH, "timeout_ms": 0}}, "request.auth_service.timeout_ms"),
    ],
)
def test_identity_configuration_errors_name_the_key(
    request_section: dict[str, Any], needle: str
) -> None:
    assert needle in _errors(request=request_section)


def test_paths_are_normalised_before_any_filter() -> None:
    hcm = _hcm(_boot(_config()))
    assert hcm["normalize_path"] is True
    assert hcm["merge_slashes"] is True
    assert hcm["path_with_escaped_slashes_action"] == "UNESCAPE_AND_FORWARD"
    assert hcm["common_http_protocol_options"]["headers_with_underscores_action"] == "DROP_HEADER"


def test_edge_limits_defaults_and_overrides() -> None:
    for edge, expect in ((None, EdgeLimits()), ({"max_requests": 500}, None)):
        config = _config(edge=edge) if edge else _config()
        limits = expect or EdgeLimits(max_requests=500)
        boot = _boot(config)
        for cluster in boot["static_resources"]["clusters"]:
            (threshold,) = cluster["circuit_breakers"]["thresholds"]
            assert threshold["max_requests"] == limits.max_requests, cluster["name"]
            assert threshold["max_pending_requests"] == limits.max_pending_requests
            assert threshold["max_retries"] == limits.max_retries
        (listener,) = boot["static_resources"]["listeners"]
        assert listener["per_connection_buffer_limit_bytes"] == limits.connection_buffer_bytes


def test_edge_timeouts_and_overload_manager() -> None:
    config = _config(
        edge={
            "request_timeout_s": 30,
            "request_headers_timeout_s": 5,
            "stream_idle_timeout_s": 0,
            "max_heap_bytes": 512 * 1024**2,
            "max_connections": 100,
        }
    )
    boot = _boot(config)
    hcm = _hcm(boot)
    # The client's 30 s come on top of the time epp may hold the request (2 s message timeout).
    assert hcm["request_timeout"] == "32s"
    assert hcm["request_headers_timeout"] == "5s"
    assert hcm["stream_idle_timeout"] == "0s"  # 0: none
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][-1]
    assert route["route"]["idle_timeout"] == "0s"
    overload = boot["overload_manager"]
    monitors = {m["name"]: m["typed_config"] for m in overload["resource_monitors"]}
    assert monitors["envoy.resource_monitors.fixed_heap"]["max_heap_size_bytes"] == 512 * 1024**2
    connections = monitors["envoy.resource_monitors.global_downstream_max_connections"]
    assert connections["max_active_downstream_connections"] == 100
    actions = {a["name"]: a["triggers"][0]["threshold"]["value"] for a in overload["actions"]}
    assert actions["envoy.overload_actions.stop_accepting_requests"] == 0.95


@pytest.mark.parametrize(
    ("edge", "needle"),
    [
        ({"max_requests": 0}, "edge.max_requests: must be an integer >= 1"),
        ({"max_heap_bytes": 1024}, "edge.max_heap_bytes"),
        ({"request_timeout_s": -1}, "edge.request_timeout_s"),
        ({"connection_buffer_bytes": 10}, "edge.connection_buffer_bytes"),
        ({"max_request": 10}, "edge.max_request: must be one of the known keys"),
    ],
)
def test_edge_errors_name_the_key(edge: dict[str, Any], needle: str) -> None:
    assert needle in _errors(edge=edge)


def test_envoy_accepts_the_identity_and_edge_rendering(tmp_path: Path) -> None:
    jwks = tmp_path / "jwks.json"
    # A syntactically valid RSA key (Envoy checks the JWKS when it loads the config).
    jwks.write_text(
        json.dumps(
            {
                "keys": [
                    {
                        "kty": "RSA",
                        "alg": "RS256",
                        "kid": "k",
                        "n": "sXchDaQebHnPiGvyDOAT4saGEUetSyo9MKLOoWFsueri23bOdgWp4Dy1Wl"
                        "UzewbgBHod5pcM9H95GQRV3JDXboIRROSBigeC5yjU1hGzHHyXss8UDprecbAYxk"
                        "nTcQkhslANGRUZmdTOQ5qTRsLAt6BTYuyvVRdhS8exSZEy_c4gs_7svlJJQ4H9_N"
                        "xsiIoLwAEk7-Q3UXERGYw_75IDrGA84-lA_-Ct4eTlXHBIY2EaV7t7LjJaynVJCp"
                        "kv4LKjTTAumiGUIuQhrNhZLuF_RJLqHpM2kgWFLU7-VTdL1VbC2tejvcI2BlMkEp"
                        "k1BzBZI0KQB0GaDWFLN-aEAw3vRw",
                        "e": "AQAB",
                    }
                ]
            }
        )
    )
    config = _config(
        request={"jwt": {**JWT, "jwks_file": str(jwks)}, "auth_service": AUTH},
        edge={"max_requests": 100, "stream_idle_timeout_s": 60},
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(render(config))
    result = validate(path)
    assert result.returncode == 0, result.stdout


def test_a_client_too_slow_with_its_headers_gets_a_json_408(tmp_path: Path) -> None:
    listen, admin = free_port(), free_port()
    config = _config(edge={"request_headers_timeout_s": 0.3})
    text = render(config, listen=f"127.0.0.1:{listen}", admin=f"127.0.0.1:{admin}")
    with (
        EnvoyProcess.start(text, admin, tmp_path),
        socket.create_connection(("127.0.0.1", listen), timeout=10) as sock,
    ):
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # and nothing more
        reply = b""
        while b"}}" not in reply:
            chunk = sock.recv(4096)
            assert chunk, reply
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"content-type: application/json" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"
