"""What admission asks about a model's replicas: are they all full, and which have room.

The answers come from the local snapshot, epp's own in-flight counts (shared by a group
through Redis) and passive health, never from the network. The saturation detector is the
current configuration's; which endpoints serve a model is the current answer (discovery
changes it under running streams), set by the router on every configuration swap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from epp.admission.saturation import SaturationDetector
from epp.observability import POOL_SATURATION
from epp.state import EndpointState
from epp.state.fleet import FleetState


class Room:
    """Saturation and room of each model's candidates (docs/admission.md)."""

    def __init__(self, fleet: FleetState, detector: Callable[[], SaturationDetector]) -> None:
        self._fleet = fleet
        self._detector = detector
        self._candidates: Mapping[str, tuple[str, ...]] = {}
        self._pools: Mapping[str, str] = {}

    def configure(
        self, candidates: Mapping[str, tuple[str, ...]], pools: Mapping[str, str]
    ) -> None:
        """Each model's candidate addresses and each address's pool (a configuration swap)."""
        self._candidates = candidates
        self._pools = pools

    def serves(self, model: str) -> bool:
        return model in self._candidates

    def candidates(self, model: str, subset: Sequence[str] | None = None) -> list[EndpointState]:
        """``model``'s candidates as the snapshot has them (``subset``: only those), an
        endpoint not scraped yet counted as not ready."""
        endpoints = self._fleet.store.snapshot().endpoints
        addresses = self._candidates.get(model, ())
        if subset is not None:
            allowed = set(subset)
            addresses = tuple(a for a in addresses if a in allowed)
        return [endpoints.get(a) or EndpointState(a, self._pools[a]) for a in addresses]

    def saturated(self, model: str, sheddable: bool = False) -> bool:
        """Every candidate of ``model`` is full (utilisation or epp's own concurrency count;
        ``sheddable``: with the share reserved for priority >= 0 counted as taken)."""
        now = time.time()
        candidates = self.candidates(model)
        # Endpoints passive health ejected get no work (the health filter), so their room is
        # no room: counted free, they let the dispatcher release the whole queue onto the
        # endpoints left. Unless all are ejected: then the filter keeps them all, and so do we.
        health = self._fleet.health
        candidates = [c for c in candidates if health.admits(c.address, now)] or candidates
        saturated = self._detector().saturated(
            candidates, now, self._fleet.inflight.load, sheddable
        )
        POOL_SATURATION.labels(model).set(float(saturated))
        return saturated

    def with_room(
        self, candidates: list[EndpointState], sheddable: bool, now: float
    ) -> list[EndpointState]:
        """The candidates that are not full, or all of them if every one is.

        Flow control releases a request because some candidate has room; scoring alone (prefix
        affinity above all) would still pick a full one, the pool would still have room, and
        the dispatcher would release the whole queue onto that one endpoint (docs/admission.md,
        Dispatch)."""
        full = self._detector().endpoint_full
        load = self._fleet.inflight.load
        return [c for c in candidates if not full(c, now, load(c.address), sheddable)] or candidates
