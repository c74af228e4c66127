"""observability.child: the label child prometheus_client's labels() would return, faster."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from epp.observability import child


def test_child_is_the_series_labels_returns_and_survives_removal() -> None:
    counter = Counter("c", "help", ["a", "b"], registry=CollectorRegistry())
    first = child(counter, "x", "y")
    assert first is counter.labels("x", "y")
    assert child(counter, "x", "y") is first  # read from the metric's own table
    first.inc()
    counter.remove("x", "y")
    again = child(counter, "x", "y")
    assert again is not first  # a removed series is created anew, not the stale one
    again.inc(2)
    assert counter.labels("x", "y")._value.get() == 2
