"""Prometheus counters and histograms for the request path, tallied in plain Python objects and
folded into their series whenever they are collected.

A ``prometheus_client`` increment or observation finds its label child, checks it, takes a lock
and (for a histogram) walks the buckets in Python, about ten times a request. The request path
instead calls :meth:`TalliedCounter.add` or :meth:`TalliedHistogram.add`: a dict update, or an
append to the series' list of pending values. ``collect`` (every scrape, and
``REGISTRY.get_sample_value``) folds what is pending into the series first, so what is scraped
is exactly what per-call increments would show: the same series, created at their first
increment as ``labels()`` would create them, the same counts and sums. Histogram values are
counted into buckets in bulk (one sort, a bisect per bucket), and a series folds on its own
once :data:`FOLD_EVERY` values are pending, which bounds the memory of a process nobody scrapes.

The tallies take no lock: the request path and the scrape handler both run on the event loop.
The ordinary ``labels(...).inc()`` / ``observe()`` still work on these metrics (rare outcomes
keep them); both kinds of update add up.

A module of its own, importing nothing of epp, so that anything may use it without cycles.
"""

from __future__ import annotations

import abc
import bisect
from collections.abc import Iterable
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

# Values pending per histogram series before they are counted into its buckets.
FOLD_EVERY = 4096


def _series(metric: MetricWrapperBase, labels: tuple[str, ...]) -> Any:
    """The series of ``labels`` (created now if absent), or the metric itself without labels."""
    return metric.labels(*labels) if labels else metric


class _Folding(MetricWrapperBase):
    """Folds what is pending (:meth:`fold`) before the metric is collected or its series
    removed: increments made before a removal go with the series, as they would have, and
    none is left waiting for a series that is gone."""

    @abc.abstractmethod
    def fold(self) -> None: ...

    def collect(self) -> Iterable[Metric]:
        self.fold()
        return super().collect()

    def remove(self, *labelvalues: Any) -> None:
        self.fold()
        super().remove(*labelvalues)

    def clear(self) -> None:
        self.fold()
        super().clear()


class TalliedCounter(_Folding, Counter):
    """A Counter whose :meth:`add` only tallies; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Label values -> (the series, the amount not yet added to it).
        self._pending: dict[tuple[str, ...], list[Any]] = {}
        super().__init__(*args, **kwargs)

    def add(self, labels: tuple[str, ...], amount: int = 1) -> None:
        """``labels(*labels).inc(amount)``, counted when the metric is next collected.
        Whole amounts only: their sum is exact in any order, so the folded total is the one
        per-call increments would reach."""
        entry = self._pending.get(labels)
        if entry is None:
            # The series exists from the first increment on, as inc() would have it.
            self._pending[labels] = [_series(self, labels), amount]
        else:
            entry[1] += amount

    def fold(self) -> None:
        """Add the tallied amounts to their series."""
        pending = self._pending
        for series, amount in pending.values():
            series.inc(amount)
        pending.clear()


class TalliedHistogram(_Folding, Histogram):
    """A Histogram whose :meth:`add` only records the value; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Label values -> (the series, the values not yet counted into it).
        self._pending: dict[tuple[str, ...], tuple[Any, list[float]]] = {}
        super().__init__(*args, **kwargs)

    def add(self, labels: tuple[str, ...], value: float) -> None:
        """``labels(*labels).observe(value)``, counted when the metric is next collected."""
        entry = self._pending.get(labels)
        if entry is None:
            entry = self._pending[labels] = (_series(self, labels), [])
        values = entry[1]
        values.append(value)
        if len(values) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        """Count the pending values into their series' buckets and sums.

        The series' own value holders are updated (prometheus_client's ``_buckets``, one per
        upper bound, ``+Inf`` last, and ``_sum``, as ``observe`` updates them;
        tests/unit/test_tallied.py pins them): a value equal to a bound counts in that bound's
        bucket, as ``observe`` and Prometheus' ``le`` have it."""
        pending = self._pending
        for series, values in pending.values():
            # Summed in arrival order, as observe() would: float addition is not associative.
            total = series._sum.get()
            for value in values:
                total += value
            series._sum.set(total)
            values.sort()
            below = 0
            for holder, bound in zip(series._buckets, series._upper_bounds, strict=True):
                upto = bisect.bisect_right(values, bound, below)
                if upto > below:
                    holder.inc(upto - below)
                below = upto
        pending.clear()
