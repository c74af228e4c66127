"""Who a request is, through the real Envoy ``epp envoy-config`` renders.

By default nothing a client sends names its priority, objective, tenant or latency target:
Envoy strips those headers before epp and the replica see them, and epp matches the API on the
normalised path only. Each trusted source is then honoured on its own: an API key, a JWT
verified by Envoy's ``jwt_authn`` against a local JWKS (valid, expired, forged, missing), and
an authorization service Envoy asks (``ext_authz``).

How a decision is observed: epp runs with ``request.engine_priority``, so the priority it chose
is the ``priority`` field of the body the replica receives (absent for 0); the tenant
``team-a`` has a budget, so its requests carry the ``x-ratelimit-*`` headers and others none.
The replica records every path and header it received.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from epp.devstack import Stack, free_port
from tests.e2e.client import Reply, request
from tests.e2e.conftest import BODY_MODES, make_stack
from tests.e2e.fleet import epp_ready_endpoints, wait_until
from tests.e2e.replica import TrickleReplica

OBJECTIVE = "x-gateway-inference-objective"
FAIRNESS = "x-gateway-inference-fairness-id"
IDENTITY = {
    "x-priority": "999999",
    OBJECTIVE: "critical",
    FAIRNESS: "team-a",
    "x-llm-d-slo-ttft-ms": "1",
    "x-llm-d-slo-tpot-ms": "1",
}
CHAT = "/v1/chat/completions"
ISSUER = "https://issuer.test"
AUDIENCE = "epp"


@dataclass
class Fleet:
    stack: Stack
    replica: TrickleReplica

    def chat(self, headers: dict[str, str] | None = None, path: str = CHAT) -> Reply:
        body = {"model": "trickle", "messages": [{"role": "user", "content": "hi"}]}
        return request(self.stack.url, path, body, headers)

    def last(self) -> tuple[str, dict[str, str], dict[str, Any]]:
        """Path, headers and body of the last request the replica received."""
        path, headers = self.replica.requests[-1]
        return path, headers, self.replica.received[-1]


def _fleet(tmp: Path, request_section: dict[str, Any], mode: str = "buffered") -> Iterator[Fleet]:
    replica = TrickleReplica()
    replica.start()
    stack = make_stack(
        tmp,
        mode,
        "memory",
        replicas=1,
        config_extra={
            "request": {
                "objectives": {"critical": 10, "batch": -1},
                "engine_priority": True,
                **request_section,
            },
            "budgets": {"tenants": {"team-a": {"rpm": 10_000}}},
            "admission": {"mode": "off"},
            "models": {"trickle": {"pools": ["trickle"]}},
            "pools": {"trickle": {"endpoints": [replica.address]}},
        },
        sim_args=["--time-scale", "0.05"],
    )
    try:
        stack.start()
        wait_until(lambda: replica.address in epp_ready_endpoints(stack), 15, "replica ready")
        yield Fleet(stack, replica)
    finally:
        stack.stop()
        replica.stop()


def _decision(fleet: Fleet) -> tuple[int, str | None]:
    """The priority epp gave the last request and its tenant if budgeted (``team-a``)."""
    _, headers, body = fleet.last()
    return -body.get("priority", 0), headers.get(FAIRNESS)


def _budgeted(reply: Reply) -> bool:
    return "x-ratelimit-limit-requests" in reply.headers


def _json_error(reply: Reply, status: int) -> dict[str, Any]:
    assert reply.status == status, (reply.status, reply.body)
    assert reply.headers["content-type"] == "application/json", reply.headers
    error: dict[str, Any] = reply.json()["error"]
    return error


# --------------------------------------------------------------------------- the default


@pytest.fixture(scope="module", params=BODY_MODES)
def default(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    keys = {"sk-a": {"tenant": "team-a", "objective": "critical"}}
    tmp = tmp_path_factory.mktemp(f"identity-default-{request.param}")
    yield from _fleet(tmp, {"api_keys": keys}, request.param)


def test_a_clients_identity_headers_reach_neither_epp_nor_the_replica(default: Fleet) -> None:
    reply = default.chat(IDENTITY)
    assert reply.status == 200, reply.body
    _, headers, body = default.last()
    assert not set(IDENTITY) & set(headers), headers
    assert "priority" not in body  # epp decided priority 0
    assert not _budgeted(reply)  # and the default tenant, not team-a


def test_an_api_key_names_tenant_and_objective(default: Fleet) -> None:
    reply = default.chat({**IDENTITY, "authorization": "Bearer sk-a"})
    assert reply.status == 200, reply.body
    _, headers, body = default.last()
    assert body["priority"] == -10  # the key's objective, not the header's 999999
    assert _budgeted(reply)
    assert "x-priority" not in headers


def test_a_dotted_path_is_normalised_before_epp_and_the_replica(default: Fleet) -> None:
    reply = default.chat(path="/v1/../admin/../v1/chat/completions")
    assert reply.status == 200, reply.body
    assert default.last()[0] == CHAT
    for path in (
        "/v1//chat///completions",
        "/v1/chat%2Fcompletions",
        "/v1/%2e%2e/v1/chat/completions",
    ):
        reply = default.chat(path=path)
        assert reply.status == 200, reply.body
        assert default.last()[0] == CHAT


def test_a_path_that_normalises_elsewhere_is_refused(default: Fleet) -> None:
    seen = len(default.replica.requests)
    # Dots that lead off the API: epp refuses what the normalised path names.
    error = _json_error(default.chat(path="/v1/chat/completions/../../../metrics"), 404)
    assert "/metrics" in error["message"]
    # Escaped slashes, which servers decode differently, are unescaped before normalising.
    error = _json_error(default.chat(path="/v1/chat/completions%2F..%2F..%5C..%5Cmetrics"), 404)
    assert "/metrics" in error["message"]
    # Only an exact API path is one.
    _json_error(default.chat(path="/x/v1/chat/completions"), 404)
    assert len(default.replica.requests) == seen


# --------------------------------------------------------------------------- JWT


@dataclass
class Keys:
    signer: rsa.RSAPrivateKey
    stranger: rsa.RSAPrivateKey


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jwk(key: rsa.RSAPrivateKey) -> dict[str, str]:
    numbers = key.public_key().public_numbers()
    as_bytes = lambda n: n.to_bytes((n.bit_length() + 7) // 8, "big")  # noqa: E731
    return {
        "kty": "RSA",
        "alg": "RS256",
        "use": "sig",
        "kid": "test",
        "n": _b64(as_bytes(numbers.n)),
        "e": _b64(as_bytes(numbers.e)),
    }


def _token(key: rsa.RSAPrivateKey, expires_in: float, **claims: str) -> str:
    header = {"alg": "RS256", "typ": "JWT", "kid": "test"}
    now = int(time.time())
    payload = {"iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": int(now + expires_in), **claims}
    signing_input = ".".join(
        _b64(json.dumps(part, separators=(",", ":")).encode()) for part in (header, payload)
    )
    signature = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing_input}.{_b64(signature)}"


@pytest.fixture(scope="module")
def keys() -> Keys:
    make = lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048)  # noqa: E731
    return Keys(make(), make())


@pytest.fixture(scope="module")
def jwt(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("identity-jwt")
    jwks = tmp / "jwks.json"
    jwks.write_text(json.dumps({"keys": [_jwk(keys.signer)]}))
    section = {"jwt": {"jwks_file": str(jwks), "issuer": ISSUER, "audiences": [AUDIENCE]}}
    yield from _fleet(tmp, section)


def test_a_valid_token_names_tenant_and_objective(jwt: Fleet, keys: Keys) -> None:
    token = _token(keys.signer, 60, tenant="team-a", objective="critical")
    # The client's own identity headers lose to the token's claims.
    spoof = {**IDENTITY, OBJECTIVE: "batch", FAIRNESS: "team-b"}
    reply = jwt.chat({**spoof, "authorization": f"Bearer {token}"})
    assert reply.status == 200, reply.body
    assert _decision(jwt) == (10, "team-a")
    assert _budgeted(reply)
    _, headers, _ = jwt.last()
    assert "x-priority" not in headers
    assert "authorization" not in headers  # the token stays at the edge


def test_an_expired_token_is_refused(jwt: Fleet, keys: Keys) -> None:
    seen = len(jwt.replica.requests)
    token = _token(keys.signer, -120, tenant="team-a", objective="critical")
    error = _json_error(jwt.chat({"authorization": f"Bearer {token}"}), 401)
    assert error["type"] == "authentication_error"
    assert "expired" in error["message"].lower()
    assert len(jwt.replica.requests) == seen


def test_a_token_signed_by_another_key_is_refused(jwt: Fleet, keys: Keys) -> None:
    seen = len(jwt.replica.requests)
    forged = _token(keys.stranger, 60, tenant="team-a", objective="critical")
    assert _json_error(jwt.chat({"authorization": f"Bearer {forged}"}), 401)["type"] == (
        "authentication_error"
    )
    assert len(jwt.replica.requests) == seen


def test_no_token_gets_the_default_identity(jwt: Fleet) -> None:
    reply = jwt.chat(IDENTITY)
    assert reply.status == 200, reply.body
    assert _decision(jwt) == (0, None)
    assert not _budgeted(reply)


# --------------------------------------------------------------------------- ext_authz


class AuthService:
    """An HTTP authorization service: ``Bearer good`` is team-a with objective batch, a
    request without credentials is anonymous (the default identity), any other is refused."""

    def __init__(self) -> None:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _check(self, request: web.Request) -> web.Response:
        if request.headers.get("authorization") == "Bearer good":
            return web.Response(headers={FAIRNESS: "team-a", OBJECTIVE: "batch"})
        if "authorization" not in request.headers:
            return web.Response()
        return web.Response(status=403, text="who are you?")

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._check)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __enter__(self) -> AuthService:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def authz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with AuthService() as service:
        section = {
            "auth_service": {
                "address": f"127.0.0.1:{service.port}",
                "headers": [FAIRNESS, OBJECTIVE],
            }
        }
        yield from _fleet(tmp_path_factory.mktemp("identity-authz"), section)


def test_the_authorization_services_headers_name_the_identity(authz: Fleet) -> None:
    reply = authz.chat({**IDENTITY, "authorization": "Bearer good"})
    assert reply.status == 200, reply.body
    assert _decision(authz) == (-1, "team-a")  # the service's batch, not the client's critical
    assert _budgeted(reply)
    assert "x-priority" not in authz.last()[1]


def test_without_credentials_the_service_leaves_the_default_identity(authz: Fleet) -> None:
    reply = authz.chat(IDENTITY)
    assert reply.status == 200, reply.body
    assert _decision(authz) == (0, None)
    assert not _budgeted(reply)


def test_the_authorization_services_refusal_reaches_the_client(authz: Fleet) -> None:
    seen = len(authz.replica.requests)
    error = _json_error(authz.chat({**IDENTITY, "authorization": "Bearer bad"}), 403)
    assert error["type"] == "authentication_error"
    assert len(authz.replica.requests) == seen
