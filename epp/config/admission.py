"""The ``admission`` section: when an endpoint is full, and what happens to requests while a
pool is saturated (docs/admission.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from epp.admission import SaturationDetector
from epp.admission.flow_queue import BandLimits, QueueLimits
from epp.admission.saturation import DEFAULT_STALE_SECONDS
from epp.config.schema import knob, section
from epp.config.walker import Node, read_section

AdmissionMode = Literal["off", "shed", "queue"]
AdmissionScope = Literal["group", "local"]


@dataclass(frozen=True, slots=True)
class FlowControl:
    """What happens when a pool is saturated (docs/admission.md): ``off`` routes anyway,
    ``shed`` refuses sheddable (priority < 0) work with 429 and routes the rest, ``queue``
    holds every request in priority bands until the pool has room. ``scope``: ``group``
    orders dispatch over the queues of every epp sharing Redis (bands and fairness shares hold
    group-wide), ``local`` over this process's queue only (the behaviour before, kept to
    compare)."""

    mode: AdmissionMode = "shed"
    limits: QueueLimits = field(default_factory=QueueLimits)
    scope: AdmissionScope = "group"


_QUEUE = QueueLimits()
_FULL = SaturationDetector()


@section("one priority band's own queue limits")
@dataclass(frozen=True, slots=True)
class BandSection:
    capacity: int | None = knob(None, ge=1, doc="requests it may hold (default: capacity)")
    ttl: float | None = knob(None, gt=0, doc="seconds each may wait (default: ttl)")


def _bands(node: Node) -> dict[int, BandSection]:
    bands: dict[int, BandSection] = {}
    for key, band in node.items():
        try:
            priority = int(key)
        except ValueError:
            band.report("must be keyed by an integer priority")
            continue
        bands[priority] = read_section(BandSection, band)
    return bands


@section("when an endpoint is full, and what a saturated pool does (docs/admission.md)")
@dataclass(frozen=True, slots=True)
class AdmissionSection:
    mode: AdmissionMode = knob(
        "shed", doc="off | shed (429 for priority < 0 when full) | queue (flow control)"
    )
    queue_threshold: int = knob(
        _FULL.queue_threshold, ge=1, doc="an endpoint is full at this many waiting requests"
    )
    kv_threshold: float = knob(
        _FULL.kv_threshold, gt=0, le=1, noun="fraction", doc="or this KV-cache usage"
    )
    stale_seconds: float | None = knob(
        None,
        gt=0,
        shape="max(0.2, 4 x scrape.interval)",
        doc="or metrics older than this",
    )
    max_requests: int = knob(0, ge=0, doc="or this many requests epp has in flight on it (0: none)")
    max_tokens: int = knob(0, ge=0, doc="or this many prompt + output tokens in flight (0: none)")
    sheddable_reserve: float = knob(
        0.0, ge=0, lt=1, noun="fraction", doc="share of those limits priority < 0 may not take"
    )
    pool_reserve: int = knob(
        0, ge=0, doc="request slots per pool kept for priority >= 0 (needs max_requests)"
    )
    capacity: int = knob(_QUEUE.default.capacity, ge=1, doc="mode queue: requests a band may hold")
    ttl: float = knob(_QUEUE.default.ttl, gt=0, doc="and seconds each may wait (then 503)")
    bands: dict[int, BandSection] = knob(
        factory=dict,
        read=_bands,
        shape="{PRIORITY: {capacity, ttl}}",
        entries=BandSection,
        doc="per-band overrides",
    )
    scope: AdmissionScope = knob(
        "group", doc="group: dispatch ordered over every epp sharing Redis; local: this one's"
    )

    def checked(self, node: Node) -> AdmissionSection:
        if self.pool_reserve and not self.max_requests:
            # The reserve is counted in request slots: without a request limit there are none.
            node.at("pool_reserve").report(
                "needs admission.max_requests > 0 (it counts request slots)"
            )
        return self


class Admission(NamedTuple):
    saturation: SaturationDetector
    flow_control: FlowControl


def build_admission(admission: AdmissionSection, scrape_interval: float) -> Admission:
    # Metrics are stale after a few missed scrapes, whatever the interval.
    stale = admission.stale_seconds or max(DEFAULT_STALE_SECONDS, 4 * scrape_interval)
    saturation = SaturationDetector(
        queue_threshold=admission.queue_threshold,
        kv_threshold=admission.kv_threshold,
        stale_seconds=stale,
        max_requests=admission.max_requests,
        max_tokens=admission.max_tokens,
        sheddable_reserve=admission.sheddable_reserve,
        pool_reserve=admission.pool_reserve if admission.max_requests else 0,
    )
    default = BandLimits(admission.capacity, admission.ttl)
    bands = {
        priority: BandLimits(band.capacity or default.capacity, band.ttl or default.ttl)
        for priority, band in admission.bands.items()
    }
    # The whole queue holds as much as its bands together (at least llm-d's 5,000).
    total = max(_QUEUE.capacity, default.capacity, sum(b.capacity for b in bands.values()))
    flow = FlowControl(admission.mode, QueueLimits(total, default, bands), admission.scope)
    return Admission(saturation, flow)
