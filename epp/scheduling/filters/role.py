"""Keep the endpoints whose prefill/decode role fits the profile (docs/pd.md).

``decode-filter`` keeps ``decode`` and ``both`` replicas (a replica without a role is ``both``):
the decode side of a disaggregated request, and whole requests, which a prefill-only replica
must not get. ``prefill-filter`` keeps ``prefill`` replicas: the prefill profile's candidates.
Unlike most filters they keep nothing when nothing fits: a role is a deployment decision, not a
preference, and the router then answers "no endpoint" (or, for the prefill profile, serves the
request without disaggregation).
"""

from __future__ import annotations

from typing import ClassVar

from epp.request import InferenceRequest
from epp.roles import Role, role_of
from epp.scheduling.framework import Cycle, Filter, register
from epp.state.snapshot import EndpointState


class RoleFilter(Filter):
    # Before health and request-specific filters: the role never changes per request.
    stage = 5
    accepts: ClassVar[frozenset[Role]] = frozenset()

    def filter(
        self, request: InferenceRequest, candidates: list[EndpointState], cycle: Cycle
    ) -> list[EndpointState]:
        roles, accepts = cycle.roles, self.accepts
        if not roles:  # nobody has a role: every endpoint is both
            return candidates if "both" in accepts else []
        return [c for c in candidates if role_of(roles, c.address) in accepts]


@register("decode-filter")
class DecodeFilter(RoleFilter):
    accepts = frozenset({"decode", "both"})


@register("prefill-filter")
class PrefillFilter(RoleFilter):
    accepts = frozenset({"prefill"})
