"""Scheduler and per-plugin latency (``llm_d_epp_scheduler_e2e_duration_seconds``,
``llm_d_epp_plugin_duration_seconds{extension_point,plugin_type,plugin_name}``).

A ``prometheus_client`` histogram's ``observe`` takes a lock and a label child per call, and
even a plain bucket tally (a bisect and two additions per lap) cost a profile of 14 laps about
a tenth of epp's CPU per request. So a lap only appends its duration to its tally's pending
list; the pending durations are sorted and counted into buckets in bulk (11 bisects per batch
instead of one per lap) once enough have gathered, and whenever Prometheus scrapes
(:class:`TimingCollector` exposes the tallies as histogram families). Runs are synchronous on
the event loop, as is the scrape handler, so the tallies need no lock.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client.core import REGISTRY, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class Plugin(Protocol):
    """What the clock needs of a scheduling plugin (structural, so epp.scheduling, which
    uses the clock, stays the only side of the import)."""

    @property
    def type_name(self) -> str: ...

    @property
    def name(self) -> str: ...


# One plugin's share of a traced scheduling run: extension point, plugin, start and end
# (perf_counter), recorded only while tracing (epp.tracing).
Lap = tuple[str, Plugin, float, float]

BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.1)


# Pending durations per tally before they are counted into buckets: bounds the memory of a
# process nobody scrapes, and is large enough for the bulk count to be cheap per duration.
FOLD_EVERY = 4096


class Tally:
    """Bucket counts and sum of one histogram series (non-cumulative until exposed), and the
    durations not yet counted (``pending``)."""

    __slots__ = ("counts", "pending", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0
        self.pending: list[float] = []

    def fold(self) -> None:
        """Count the pending durations into the buckets (a duration equal to a bound counts
        in that bound's bucket, as Prometheus' ``le`` says)."""
        pending = self.pending
        if not pending:
            return
        pending.sort()
        counts = self.counts
        below = 0
        for i, bound in enumerate(BUCKETS):
            upto = bisect.bisect_right(pending, bound, below)
            counts[i] += upto - below
            below = upto
        counts[-1] += len(pending) - below
        self.total += sum(pending)
        pending.clear()

    def buckets(self) -> list[tuple[str, float]]:
        self.fold()
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*map(str, BUCKETS), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


class TimingCollector(Collector):
    """Exposes the scheduler's tallies; a profile rebuilt on reload reuses its plugins' tallies
    (same extension point, type and name), so label sets stay those of the configuration."""

    def __init__(self) -> None:
        self.e2e = Tally()
        self.plugins: dict[tuple[str, str, str], Tally] = {}

    def tally(self, point: str, plugin: Plugin) -> Tally:
        key = (point, plugin.type_name, plugin.name)
        return self.plugins.setdefault(key, Tally())

    def fold(self) -> None:
        """Count every tally's pending durations (when enough have gathered; scrapes count
        them anyway)."""
        self.e2e.fold()
        for tally in self.plugins.values():
            tally.fold()

    def collect(self) -> Iterator[Metric]:
        e2e = HistogramMetricFamily(
            "llm_d_epp_scheduler_e2e_duration_seconds",
            "One run of the scheduling profile: producers, filters, scorers, picker, post-pick.",
        )
        e2e.add_metric([], self.e2e.buckets(), self.e2e.total)
        yield e2e
        per_plugin = HistogramMetricFamily(
            "llm_d_epp_plugin_duration_seconds",
            "One plugin's share of a scheduling run, by extension point (producer, filter, "
            "scorer, picker, post_pick), plugin type and configured name.",
            labels=["extension_point", "plugin_type", "plugin_name"],
        )
        for labels, tally in sorted(self.plugins.items()):
            per_plugin.add_metric(list(labels), tally.buckets(), tally.total)
        yield per_plugin


TIMING = TimingCollector()
REGISTRY.register(TIMING)


class PluginClock:
    """The tallies of one profile's plugins, and its runs' end-to-end times.

    The profile times its plugins itself (:meth:`epp.scheduling.framework.Profile.run`): it
    asks once for each plugin's :meth:`sink` and appends a duration to it per run, a list
    append where a method call with two table lookups used to be, 14 times a request."""

    __slots__ = ("_tallies",)

    def __init__(self, plugins: Iterable[tuple[str, Plugin]]) -> None:
        # By extension point first: one plugin may run at several (a prefix scorer produces,
        # scores and records its pick), and each lap belongs to the point it ran at.
        self._tallies: dict[str, dict[int, Tally]] = {}
        for point, plugin in plugins:
            self._tallies.setdefault(point, {})[id(plugin)] = TIMING.tally(point, plugin)

    def sink(self, point: str, plugin: Plugin) -> list[float]:
        """Where ``plugin``'s durations at extension ``point`` go (its tally's pending list,
        the same list for the tally's whole life: folding empties it in place)."""
        return self._tallies[point][id(plugin)].pending

    def stop(self, started: float) -> None:
        """A run that began at ``started`` (``time.perf_counter``) ended now."""
        pending = TIMING.e2e.pending
        pending.append(time.perf_counter() - started)
        # Every run ends here once, and no tally gets more than a lap or two per run.
        if len(pending) >= FOLD_EVERY:
            TIMING.fold()
