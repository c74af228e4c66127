"""The one interface every endpoint source implements."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from epp.roles import Role


class Publish(Protocol):
    """Receives the complete endpoint set of one pool (``ip:port`` / ``[v6]:port``) each time
    it changes. Full sets, not deltas: a consumer that missed nothing and one that just started
    see the same thing, and a source can never leave a stale endpoint behind by losing a
    "removed". ``roles``: the prefill/decode role of members that have one, when the source
    learns roles per member (Kubernetes labels)."""

    def __call__(
        self, members: frozenset[str], roles: Mapping[str, Role] | None = None
    ) -> None: ...


class EndpointSource(Protocol):
    """Follows one pool's membership until cancelled.

    ``run`` publishes the current set as soon as it knows it and again after every change. It
    handles its own transient errors (retry with back-off, keeping the last set published);
    it returns only if the set can never change again (a static list).
    """

    async def run(self, publish: Publish) -> None: ...
