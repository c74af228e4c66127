"""epp.tallied: what a tallied metric exposes equals what per-call increments expose."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram

from epp.tallied import FOLD_EVERY, TalliedCounter, TalliedHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)


def _samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    """Every sample but the series' creation times (which differ between two metrics)."""
    return sorted(
        (
            (s.name, s.labels, s.value)
            for m in registry.collect()
            for s in m.samples
            if not s.name.endswith("_created")
        ),
        key=lambda s: (s[0], sorted(s[1].items())),
    )


def _created(registry: CollectorRegistry) -> list[tuple[str, list[tuple[str, str]]]]:
    """Which series have a creation time (the same series exist in both)."""
    return sorted(
        (s.name, sorted(s.labels.items()))
        for m in registry.collect()
        for s in m.samples
        if s.name.endswith("_created")
    )


def _pair() -> tuple[CollectorRegistry, CollectorRegistry]:
    return CollectorRegistry(), CollectorRegistry()


def test_counter_tallies_scrape_as_increments_do() -> None:
    plain_registry, tallied_registry = _pair()
    plain = Counter("c", "help", ["a", "b"], registry=plain_registry)
    tallied = TalliedCounter("c", "help", ["a", "b"], registry=tallied_registry)
    rng = random.Random(7)
    for _ in range(500):
        labels = (rng.choice("xyz"), rng.choice("uv"))
        amount = rng.choice((0, 1, 1, 3, 250))
        plain.labels(*labels).inc(amount)
        tallied.add(labels, amount)
        if rng.random() < 0.05:  # scrapes in between fold what is pending so far
            assert _samples(tallied_registry) == _samples(plain_registry)
    assert _samples(tallied_registry) == _samples(plain_registry)
    assert _created(tallied_registry) == _created(plain_registry)


def test_counter_mixes_direct_increments_and_labelless_use() -> None:
    plain_registry, tallied_registry = _pair()
    plain = Counter("c", "help", ["a"], registry=plain_registry)
    tallied = TalliedCounter("c", "help", ["a"], registry=tallied_registry)
    bare = TalliedCounter("bare", "help", registry=tallied_registry)
    Counter("bare", "help", registry=plain_registry).inc(5)
    for metric in (plain, tallied):
        metric.labels("x").inc(2)
    plain.labels("x").inc(3)
    tallied.add(("x",), 3)
    bare.add((), 2)
    bare.add((), 3)
    assert _samples(tallied_registry) == _samples(plain_registry)


def test_counter_series_exists_from_its_first_tally() -> None:
    registry = CollectorRegistry()
    tallied = TalliedCounter("c", "help", ["a"], registry=registry)
    tallied.add(("x",), 0)
    assert tallied._pending  # not folded yet, yet the series is there, as inc(0) makes it
    assert ("x",) in tallied._metrics
    assert registry.get_sample_value("c_total", {"a": "x"}) == 0.0


def test_removal_and_clearing_keep_what_came_before_and_after_them() -> None:
    """Updates pending when a series is removed (or all are) go with it; later ones recreate
    it, with no scrape in between to fold them."""
    plain_registry, tallied_registry = _pair()
    plain = Counter("c", "help", ["a"], registry=plain_registry)
    tallied = TalliedCounter("c", "help", ["a"], registry=tallied_registry)
    plain_h = Histogram("h", "help", ["a"], buckets=BUCKETS, registry=plain_registry)
    tallied_h = TalliedHistogram("h", "help", ["a"], buckets=BUCKETS, registry=tallied_registry)

    def update(value: int) -> None:
        plain.labels("x").inc(value)
        tallied.add(("x",), value)
        plain_h.labels("x").observe(value / 10)
        tallied_h.add(("x",), value / 10)

    for clear in (False, True):
        update(1)
        update(2)
        for metric in (plain, tallied, plain_h, tallied_h):
            if clear:
                metric.clear()
            else:
                metric.remove("x")
        update(4)
        assert _samples(tallied_registry) == _samples(plain_registry)
        assert tallied_registry.get_sample_value("c_total", {"a": "x"}) == 4


def test_histogram_buckets_and_sum_equal_observe_bit_for_bit() -> None:
    plain_registry, tallied_registry = _pair()
    plain = Histogram("h", "help", ["a"], buckets=BUCKETS, registry=plain_registry)
    tallied = TalliedHistogram("h", "help", ["a"], buckets=BUCKETS, registry=tallied_registry)
    rng = random.Random(11)
    # Values on the bounds count in that bound's bucket; sums of these floats depend on the
    # order they are added in, so an order-blind sum would show here.
    values = [*BUCKETS, -0.5, 0.0, 1e9, *(rng.lognormvariate(-3, 2) for _ in range(3000))]
    for value in values:
        labels = (rng.choice("xy"),)
        plain.labels(*labels).observe(value)
        tallied.add(labels, value)
        if rng.random() < 0.01:
            assert _samples(tallied_registry) == _samples(plain_registry)
    assert _samples(tallied_registry) == _samples(plain_registry)
    assert _created(tallied_registry) == _created(plain_registry)


def test_histogram_without_labels() -> None:
    plain_registry, tallied_registry = _pair()
    plain = Histogram("h", "help", buckets=BUCKETS, registry=plain_registry)
    tallied = TalliedHistogram("h", "help", buckets=BUCKETS, registry=tallied_registry)
    for value in (0.0005, 0.05, 5.0, 50.0):
        plain.observe(value)
        tallied.add((), value)
    assert _samples(tallied_registry) == _samples(plain_registry)


def test_histogram_folds_by_itself_when_enough_are_pending() -> None:
    """Bounded memory without scrapes; this also pins the prometheus_client internals the fold
    writes to (``_buckets``, ``_upper_bounds``, ``_sum``)."""
    tallied = TalliedHistogram("h", "help", ["a"], buckets=BUCKETS, registry=None)
    for _ in range(FOLD_EVERY - 1):
        tallied.add(("x",), 0.05)
    assert len(tallied._pending[("x",)][1]) == FOLD_EVERY - 1
    tallied.add(("x",), 0.05)
    assert not tallied._pending
    series = tallied.labels("x")
    assert [b.get() for b in series._buckets] == [0, 0, FOLD_EVERY, 0, 0, 0]
    assert series._upper_bounds[-1] == float("inf")
    assert series._sum.get() == sum([0.05] * FOLD_EVERY)
