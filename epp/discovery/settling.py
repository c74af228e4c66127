"""Which discovered endpoints Envoy may not know yet.

A DNS pool is resolved twice: by epp (to schedule) and by Envoy's STRICT_DNS cluster (to
connect), each every ``interval``, unsynchronised. For up to about one interval after epp sees
a new replica, Envoy's cluster may lack it; ``override_host`` then skips that address and takes
the next one of epp's list (docs/discovery.md). A fresh, idle replica is exactly what the
load scorers prefer, so after a scale-up by two or more the whole list could name replicas
Envoy has not resolved yet, and the request fail with 503 although old replicas could serve
it (seen in the compose stack's ``--scale sim=4`` check). :class:`Settling` tells the router
which endpoints are still within that window, so that every list keeps one Envoy surely knows.

The window ends at the first response Envoy serves from the replica (then it is surely in
Envoy's cluster), and otherwise after :data:`SETTLE_INTERVALS` intervals. A time alone was not
enough: Envoy's resolution can lag epp's by more than the one interval both are configured
with (a CI run of the compose stack, 1 s intervals: Envoy still lacked two new replicas 2.1 s
after epp had them, and a list naming only those two got a 503).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from epp.discovery.spec import DiscoverySpec, DnsSpec

# The bound for a replica Envoy never serves (epp never picks it, or it fails every attempt).
# Long, because a served response usually ends the window within an interval or two, and a
# settling replica costs little: a list ending with it gets one more entry, and Envoy skipping
# it is not counted as its failure (a broken new replica is judged by its scrapes meanwhile).
SETTLE_INTERVALS = 10.0


class Settling:
    """Endpoints of DNS pools that joined less than :data:`SETTLE_INTERVALS` intervals ago."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until: dict[str, float] = {}  # address -> when Envoy surely has it
        self._known: set[str] = set()  # every DNS-pool address seen so far
        self._resolved: set[str] = set()  # DNS pools that have had members

    def update(
        self, pools: Mapping[str, tuple[str, ...]], discovery: Mapping[str, DiscoverySpec]
    ) -> None:
        """The pools' members now. A pool's first members count as known: epp and Envoy
        resolve them at start alike (and nothing older exists to fall back on anyway)."""
        now = self._clock()
        present: set[str] = set()
        for pool, spec in discovery.items():
            members = pools.get(pool, ())
            if not isinstance(spec, DnsSpec) or not members:
                continue
            first = pool not in self._resolved
            self._resolved.add(pool)
            for address in members:
                present.add(address)
                if not first and address not in self._known:
                    self._until[address] = now + SETTLE_INTERVALS * spec.interval
        self._known = present
        for address in list(self._until):
            if address not in present:
                del self._until[address]

    def settling(self, address: str) -> bool:
        """Whether Envoy may not have resolved ``address`` yet."""
        until = self._until.get(address)
        if until is None:
            return False
        if until <= self._clock():
            del self._until[address]
            return False
        return True

    def served(self, address: str) -> None:
        """Envoy served a response from ``address``: it has resolved it."""
        self._until.pop(address, None)

    def any(self) -> bool:
        return bool(self._until)
