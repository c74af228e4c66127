"""The simulator's own text exposition: what prometheus_client would write, rendered lazily."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge as PGauge
from prometheus_client import Histogram as PHistogram
from prometheus_client.parser import text_string_to_metric_families

from epp.sim.exposition import Counter, Gauge, Histogram, Registry

LABELS = {"model_name": 'a "quoted"\\name', "engine": "0"}
BUCKETS = [0.1, 1.0, 2.5, 1e7]


def _without_created(text: bytes) -> list[str]:
    return [line for line in text.decode().splitlines() if "_created" not in line]


def test_same_text_as_prometheus_client_apart_from_created_timestamps() -> None:
    ours = Registry()
    g = ours.add(Gauge("g", "a gauge\nwith a newline")).labels(**LABELS)
    c = ours.add(Counter("c", "a counter")).labels(**LABELS)
    h = ours.add(Histogram("h", "a histogram", BUCKETS)).labels(**LABELS)
    empty = ours.add(Gauge("e", "no series yet"))

    theirs = CollectorRegistry()
    names = list(LABELS)
    pg = PGauge("g", "a gauge\nwith a newline", names, registry=theirs).labels(**LABELS)
    pc = PCounter("c", "a counter", names, registry=theirs).labels(**LABELS)
    ph = PHistogram("h", "a histogram", names, buckets=BUCKETS, registry=theirs).labels(**LABELS)
    PGauge("e", "no series yet", ["x"], registry=theirs)

    for target in (g, pg):
        target.set(3)
    for target in (c, pc):
        target.inc(2)
    for value in (0.05, 1.0, 1.5, 3e7):  # 1.0 sits on a bound: "le" includes it
        h.observe(value)
        ph.observe(value)
    assert not empty.children
    assert _without_created(ours.render()) == _without_created(generate_latest(theirs))


def test_a_change_after_a_render_shows_in_the_next_render() -> None:
    reg = Registry()
    h = reg.add(Histogram("h", "doc", BUCKETS)).labels(engine="0")
    c = reg.add(Counter("c", "doc")).labels(engine="0")
    first = reg.render()
    assert reg.render() == first
    h.observe(0.5)
    c.inc()
    families = {f.name: f for f in text_string_to_metric_families(reg.render().decode())}
    buckets = {s.labels["le"]: s.value for s in families["h"].samples if s.name == "h_bucket"}
    assert buckets == {"0.1": 0, "1.0": 1, "2.5": 1, "1e+07": 1, "+Inf": 1}
    assert [s.value for s in families["c"].samples if s.name == "c_total"] == [1.0]


def test_setting_a_gauge_to_its_current_value_keeps_the_cached_text() -> None:
    reg = Registry()
    family = reg.add(Gauge("g", "doc"))
    child = family.labels(engine="0")
    reg.render()
    child.set(0)
    assert family._text is not None
    child.set(1)
    assert family._text is None
