"""Who a request is and what it may claim: the header policy (:class:`RequestPolicy`), API
keys, latency targets, and reading priority, fairness id, objective and session from trusted
sources only (docs/identity.md)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from epp import wire
from epp.errors import bad_request

# A session header longer than this is refused (400): ids are UUIDs or short tokens, and a
# longer one would be forwarded to the replica, which may refuse it less clearly.
MAX_SESSION_BYTES = 1024
# Sessions are kept, and shipped to the other epps, as this many bytes of BLAKE2b of the
# header (in hex): a table entry and a picks-stream item have the same size whatever was sent.
SESSION_DIGEST_BYTES = 16


@dataclass(frozen=True, slots=True)
class LatencyTarget:
    """A request's latency targets in seconds: time to first token and time per output token
    (None: no target of that kind)."""

    ttft: float | None = None
    tpot: float | None = None

    def __bool__(self) -> bool:
        return self.ttft is not None or self.tpot is not None

    def met(self, ttft: float, tpot: float) -> bool:
        """Whether a response with this TTFT and TPOT (predicted or measured) meets it."""
        return (self.ttft is None or ttft <= self.ttft) and (self.tpot is None or tpot <= self.tpot)

    def headroom_used(self, ttft: float, tpot: float) -> float:
        """The tightest of the targets' fractions used (1: just met), for preferring the
        endpoint that meets the targets with the least speed to spare."""
        used = [v / t for v, t in ((ttft, self.ttft), (tpot, self.tpot)) if t is not None]
        return max(used, default=0.0)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """Who a bearer API key belongs to: its fairness id and (optionally) its objective."""

    tenant: str
    objective: str | None = None


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """Which headers carry priority, objective, fairness id and session, how objectives map to
    priorities, and which of those sources are trusted (docs/identity.md).

    Nothing a client sends is trusted by default. A request whose ``authorization: Bearer KEY``
    is in ``api_keys`` gets that key's tenant and objective whatever its headers say. Else a
    header is read only when the configuration names who sets it: every identity and SLO header
    when ``trusted_headers`` says a gateway in front sets them all (overwriting client copies),
    or the ``authenticated_headers`` an authenticating filter of the rendered Envoy sets (JWT
    claims, an external authorization service) after Envoy stripped the client's copies.
    Anything else gets the default objective and flow.
    """

    session_header: str = wire.SESSION_HEADER
    priority_header: str = wire.PRIORITY_HEADER
    objective_header: str = wire.OBJECTIVE_HEADER
    fairness_header: str = wire.FAIRNESS_HEADER
    objectives: Mapping[str, int] = field(default_factory=dict)
    # Objectives whose requests may go to an overflow pool (docs/admission.md, spillover).
    spill_objectives: frozenset[str] = frozenset()
    # Latency targets of objectives that have them (objectives.NAME.ttft_ms / tpot_ms).
    objective_targets: Mapping[str, LatencyTarget] = field(default_factory=dict)
    trusted_headers: bool = False
    authenticated_headers: frozenset[str] = frozenset()
    api_keys: Mapping[str, ApiKey] = field(default_factory=dict)
    # Write the request's priority into the forwarded body as vLLM's ``priority`` field (for
    # engines run with ``--scheduling-policy priority``; docs/admission.md, engine priority).
    engine_priority: bool = False

    def trusts(self, header: str) -> bool:
        """Whether header ``header``'s value comes from a trusted source, not the client."""
        return self.trusted_headers or header in self.authenticated_headers

    def identity_headers(self) -> tuple[str, ...]:
        """Every header that names a priority, objective, tenant or latency target: the ones
        Envoy strips from clients unless the configuration trusts them."""
        return (
            self.priority_header,
            self.objective_header,
            self.fairness_header,
            wire.SLO_TTFT_HEADER,
            wire.SLO_TPOT_HEADER,
        )


def identity(headers: Mapping[str, str], policy: RequestPolicy) -> tuple[int, str, str]:
    """Priority, fairness id and objective name, from trusted sources only: an untrusted
    client's headers cannot raise its priority, pose as another tenant or claim an objective."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    key = policy.api_keys.get(token.strip()) if scheme.lower() == "bearer" else None
    if key is not None:
        objective = key.objective or ""
        return policy.objectives.get(objective, 0), key.tenant, objective
    objective = (
        headers.get(policy.objective_header, "") if policy.trusts(policy.objective_header) else ""
    )
    if objective not in policy.objectives:
        objective = ""
    fairness_id = (
        headers.get(policy.fairness_header) if policy.trusts(policy.fairness_header) else None
    )
    return _priority(headers, policy, objective), fairness_id or wire.DEFAULT_FLOW, objective


def session(headers: Mapping[str, str], name: str) -> str | None:
    """The request's session key: a fixed-size digest of its session header (None without
    one); a header over :data:`MAX_SESSION_BYTES` is a 400."""
    raw = headers.get(name)
    if not raw:
        return None
    encoded = raw.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_SESSION_BYTES:
        raise bad_request(
            f"Header '{name}' must be at most {MAX_SESSION_BYTES} bytes, got {len(encoded)}.",
            name,
        )
    return session_key(encoded)


def session_key(raw: bytes) -> str:
    """What the session tables store for a session header's bytes."""
    return hashlib.blake2b(raw, digest_size=SESSION_DIGEST_BYTES).hexdigest()


def _priority(headers: Mapping[str, str], policy: RequestPolicy, objective: str) -> int:
    """A trusted priority header, else the objective's priority (0 for none)."""
    raw = headers.get(policy.priority_header) if policy.trusts(policy.priority_header) else None
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            raise bad_request(
                f"Header '{policy.priority_header}' must be an integer, got '{raw}'."
            ) from None
    return policy.objectives.get(objective, 0)
