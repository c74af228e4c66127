"""The ``request`` section: identity headers, objectives, API keys, JWT and an ext_authz
service (docs/identity.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import yaml

from epp import wire
from epp.config.pools import host_port_or_empty
from epp.config.schema import knob, section
from epp.config.walker import Node, deferred, read_section
from epp.edge import Authentication, AuthService, JwtAuth
from epp.request import ApiKey, LatencyTarget, RequestPolicy
from epp.secrets import SecretError, expand, read_file

# An API-key map of a few hundred thousand keys; a larger file is a wrong path.
MAX_API_KEYS_FILE_BYTES = 16 * 1024 * 1024


def _non_empty_strings(node: Node) -> tuple[str, ...]:
    found = []
    for item in node.list():
        if isinstance(item.value, str) and item.value:
            found.append(item.value)
        else:
            item.report(f"must be a non-empty string, got {item.value!r}")
    return tuple(found)


_JWT = JwtAuth("", "")


@section("tokens Envoy verifies against a local JWKS file; claims name the identity")
@dataclass(frozen=True, slots=True)
class JwtSection:
    jwks_file: str = knob("", doc="absolute path of the JWKS file (Envoy reads it)")
    issuer: str = knob("", doc="the tokens' iss claim")
    audiences: tuple[str, ...] = knob(
        (), read=_non_empty_strings, shape="[string]", doc="accepted aud claims (none: any)"
    )
    tenant_claim: str = knob(_JWT.tenant_claim, doc="claim holding the fairness id")
    objective_claim: str = knob(_JWT.objective_claim, doc="claim holding the objective")
    required: bool = knob(_JWT.required, doc="refuse requests without a token (401)")

    def checked(self, node: Node) -> JwtSection:
        if not self.jwks_file.startswith("/"):
            node.at("jwks_file").report(
                f"must be an absolute path to a JWKS file (Envoy reads it), got {self.jwks_file!r}"
            )
        if not self.issuer:
            node.at("issuer").report("must be a non-empty string (the tokens' iss claim)")
        for key in ("tenant_claim", "objective_claim"):
            if not getattr(self, key):
                node.at(key).report("must be a non-empty claim name")
        return self


@section("an ext_authz service that may set the listed identity headers")
@dataclass(frozen=True, slots=True)
class AuthServiceSection:
    address: str = knob(
        "",
        required=True,
        read=host_port_or_empty,
        shape="host:port",
        doc="the service (gRPC)",
    )
    headers: tuple[str, ...] = knob(
        (),
        required=True,
        shape="[header]",
        doc="identity headers it may set (the others stay stripped)",
    )
    timeout_ms: int = knob(AuthService("", ()).timeout_ms, ge=1, doc="per check")


@section("an objective: its priority, whether it may spill, its latency targets")
@dataclass(frozen=True, slots=True)
class ObjectiveSection:
    priority: int = knob(0, required=True, doc="higher is served first; < 0 is sheddable")
    spill: bool = knob(False, doc="may go to an overflow pool")
    ttft_ms: float | None = knob(None, gt=0, doc="time-to-first-token target (ms)")
    tpot_ms: float | None = knob(None, gt=0, doc="time-per-output-token target (ms)")


@section("the identity a Bearer API key stands for")
@dataclass(frozen=True, slots=True)
class ApiKeySection:
    tenant: str = knob("", doc="its fairness id")
    objective: str | None = knob(None, doc="its objective (one of request.objectives)")

    def checked(self, node: Node) -> ApiKeySection:
        if not self.tenant:
            node.at("tenant").report("must be a non-empty string (the key's fairness id)")
        return self


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _objectives(node: Node) -> dict[str, ObjectiveSection]:
    """Each objective: a priority, or a mapping with one."""
    found: dict[str, ObjectiveSection] = {}
    for name, value in node.items():
        if isinstance(value.value, dict):
            objective = read_section(ObjectiveSection, value)
            if _is_int(value.at("priority").value):  # else reported
                found[name] = objective
        elif _is_int(value.value):
            found[name] = ObjectiveSection(value.value)
        else:
            value.report(f"must be an integer priority, got {value.value!r}")
    return found


@section("who a request is and what it asks for (docs/identity.md)")
@dataclass(frozen=True, slots=True)
class RequestSection:
    session_header: str = knob(wire.SESSION_HEADER, doc="session affinity")
    priority_header: str = knob(wire.PRIORITY_HEADER, doc="integer priority")
    objective_header: str = knob(wire.OBJECTIVE_HEADER, doc="named objective")
    fairness_header: str = knob(wire.FAIRNESS_HEADER, doc="tenant: round-robin within a band")
    objectives: Mapping[str, ObjectiveSection] = knob(
        factory=dict,
        read=_objectives,
        shape="{NAME: PRIORITY | {priority, spill, ttft_ms, tpot_ms}}",
        entries=ObjectiveSection,
        doc="named objectives (an InferencePool's InferenceObjectives merge in and win)",
    )
    trusted_headers: bool = knob(
        False, doc="true only behind a gateway that sets the identity headers itself"
    )
    api_keys: Any = knob(
        None,
        read=deferred,
        shape="{KEY: {tenant, objective}}",
        entries=ApiKeySection,
        doc="Bearer key -> identity (never echoed: a problem names the entry's position)",
    )
    api_keys_file: str = knob("", doc="a YAML file holding the api_keys map (keys may be ${ENV})")
    engine_priority: bool = knob(False, doc="set the body's priority for vLLM (-priority)")
    jwt: JwtSection | None = knob(None, doc="Envoy verifies JWTs (docs/identity.md)")
    auth_service: AuthServiceSection | None = knob(None, doc="an ext_authz service")


class Identity(NamedTuple):
    policy: RequestPolicy
    authentication: Authentication


def build_request(section_: RequestSection, node: Node) -> Identity:
    """The request policy and the rendered Envoy's authenticating filters."""
    objectives = section_.objectives
    api_keys: dict[str, ApiKey] = {}
    for key, entry in _api_key_entries(node):
        identity = read_section(ApiKeySection, entry)
        objective = identity.objective or None
        if objective is not None and objective not in objectives:
            entry.at("objective").report(f"must name one of request.objectives, got {objective!r}")
        api_keys[key] = ApiKey(identity.tenant, objective)
    targets = {
        name: LatencyTarget(*(ms / 1000 if ms else None for ms in (o.ttft_ms, o.tpot_ms)))
        for name, o in objectives.items()
        if o.ttft_ms or o.tpot_ms
    }
    policy = RequestPolicy(
        session_header=section_.session_header.lower(),
        priority_header=section_.priority_header.lower(),
        objective_header=section_.objective_header.lower(),
        fairness_header=section_.fairness_header.lower(),
        objectives={name: o.priority for name, o in objectives.items()},
        spill_objectives=frozenset(name for name, o in objectives.items() if o.spill),
        objective_targets=targets,
        trusted_headers=section_.trusted_headers,
        api_keys=api_keys,
        engine_priority=section_.engine_priority,
    )
    authentication = Authentication(
        None if section_.jwt is None else _jwt(section_.jwt),
        _auth_service(section_.auth_service, node.at("auth_service"), policy),
    )
    _check_identity(policy, authentication, node)
    authenticated = authentication.headers_set(policy.fairness_header, policy.objective_header)
    return Identity(
        dataclasses.replace(policy, authenticated_headers=authenticated), authentication
    )


def _jwt(jwt: JwtSection) -> JwtAuth:
    return JwtAuth(
        jwks_file=jwt.jwks_file,
        issuer=jwt.issuer,
        audiences=jwt.audiences,
        tenant_claim=jwt.tenant_claim,
        objective_claim=jwt.objective_claim,
        required=jwt.required,
    )


def _auth_service(
    service: AuthServiceSection | None, node: Node, policy: RequestPolicy
) -> AuthService | None:
    if service is None:
        return None
    allowed = policy.identity_headers()
    headers = []
    for index, name in enumerate(service.headers):
        if name.lower() not in allowed:
            node.at("headers").at(index).report(
                f"must be one of the identity headers {', '.join(allowed)}, got {name!r}"
            )
        else:
            headers.append(name.lower())
    return AuthService(service.address, tuple(headers), service.timeout_ms)


def _check_identity(policy: RequestPolicy, authentication: Authentication, node: Node) -> None:
    if policy.trusted_headers and (authentication.jwt or authentication.service):
        node.at("trusted_headers").report(
            "must be false with jwt or auth_service: Envoy then authenticates requests and "
            "sets the identity headers itself, and must strip every client copy"
        )
    if authentication.jwt is not None and policy.api_keys:
        node.at("api_keys").report(
            "cannot be used with jwt: both read the authorization header, and Envoy refuses "
            "a bearer token that is not a valid JWT"
        )


def _api_key_entries(node: Node) -> list[tuple[str, Node]]:
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
        keys = Node(data, f"{node.path}.api_keys_file", node.source, node.errors)
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
