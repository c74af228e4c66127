"""What admission asks about a model's replicas: are they all full, and which have room.

The answers come from the local snapshot, epp's own in-flight counts (shared by a group
through Redis) and passive health, never from the network. The saturation detector is the
current configuration's; which endpoints serve a model is the current answer (discovery
changes it under running streams), set by the router on every configuration swap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from epp.admission.objectives import Headroom, Objectives
from epp.admission.saturation import SaturationDetector
from epp.observability import POOL_SATURATION
from epp.state import EndpointState
from epp.state.fleet import FleetState
from epp.state.inflight import Load


class Room:
    """Saturation and room of each model's candidates (docs/admission.md)."""

    def __init__(
        self,
        fleet: FleetState,
        detector: Callable[[], SaturationDetector],
        objectives: Callable[[], Objectives],
    ) -> None:
        self._fleet = fleet
        self._detector = detector
        self._objectives = objectives
        # What the objectives' room is measured with (epp.admission.objectives).
        self.headroom = Headroom(fleet.latency.predict_ttft)
        self._candidates: Mapping[str, tuple[str, ...]] = {}
        self._pools: Mapping[str, str] = {}

    def configure(
        self, candidates: Mapping[str, tuple[str, ...]], pools: Mapping[str, str]
    ) -> None:
        """Each model's candidate addresses and each address's pool (a configuration swap)."""
        self._candidates = candidates
        self._pools = pools
        self.headroom.forget(pools)

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

    def saturated(self, model: str, priority: int = 0) -> bool:
        """Is there no room in ``model``'s pool for a request of ``priority``? Every candidate
        is full (utilisation, or epp's own concurrency count with the share reserved for
        priority >= 0 counted as taken for sheddable work); or, with objectives and no
        explicit limit (:meth:`learned`), every candidate is unready, stale or has a long
        queue, or releasing the request would leave a higher priority too few free decode
        slots on the replicas that meet its target. Decode slots hold back only the work
        below a protected priority: the highest goes on to the engines."""
        now = time.time()
        candidates = self.candidates(model)
        # Endpoints passive health ejected get no work (the health filter), so their room is
        # no room: counted free, they let the dispatcher release the whole queue onto the
        # endpoints left. Unless all are ejected: then the filter keeps them all, and so do we.
        health = self._fleet.health
        candidates = [c for c in candidates if health.admits(c.address, now)] or candidates
        detector = self._detector()
        load = self._fleet.inflight.load
        objectives = self.learned()
        if objectives.protected:
            open_ = [c for c in candidates if not detector.endpoint_full(c, now, kv=False)]
            saturated = not open_ or not self.headroom.allows(
                priority, objectives, open_, load, now
            )
        else:
            saturated = detector.saturated(candidates, now, load, priority < 0)
        POOL_SATURATION.labels(model).set(float(saturated))
        return saturated

    def _full(
        self, detector: SaturationDetector, endpoint: EndpointState, now: float, load: Load
    ) -> bool:
        """No room for one more request with admission driven by objectives: not ready, stale
        metrics, a long queue, or no free decode slot (which measures the KV cache instead of
        ``kv_threshold``)."""
        return detector.endpoint_full(endpoint, now, kv=False) or (
            self.headroom.free_slots(endpoint, load) < 1
        )

    def learned(self) -> Objectives:
        """The objectives admission protects by prediction: none while an explicit limit
        (``max_requests``, ``max_tokens``) says what room is."""
        detector = self._detector()
        if detector.max_requests or detector.max_tokens:
            return Objectives()
        return self._objectives()

    def arrived(self, priority: int, prompt_tokens: int) -> None:
        """A request arrived: its size teaches what its priority's requests take."""
        configured = self._objectives().priorities
        self.headroom.arrived(priority, prompt_tokens, configured, time.time())

    def with_room(
        self, candidates: list[EndpointState], priority: int, now: float
    ) -> list[EndpointState]:
        """The candidates that are not full, or all of them if every one is.

        Flow control releases a request because some candidate has room; scoring alone (prefix
        affinity above all) would still pick a full one, the pool would still have room, and
        the dispatcher would release the whole queue onto that one endpoint (docs/admission.md,
        Dispatch). With learned room, a candidate needs a free decode slot; among those left
        the profile chooses (prefix affinity)."""
        detector = self._detector()
        load = self._fleet.inflight.load
        if self.learned().protected:
            kept = [c for c in candidates if not self._full(detector, c, now, load(c.address))]
        else:
            full, sheddable = detector.endpoint_full, priority < 0
            kept = [c for c in candidates if not full(c, now, load(c.address), sheddable)]
        return kept or candidates
