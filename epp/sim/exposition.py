"""Prometheus text exposition for the simulator, re-rendered only where something changed.

Why not ``prometheus_client.generate_latest``: epp, like GIE, scrapes every replica every 50 ms,
and generate_latest rebuilds every sample of the ~330-line vLLM page on each call.
On a real fleet that CPU belongs to each GPU host; in the dev stack and the benchmarks all
simulated replicas share the router's cores, so it showed up as TTFT in every epp row. Here each
family keeps its rendered text and only a family that changed since the last scrape is rendered
again. The output is the text format prometheus_client 0.2x writes, which is what vLLM serves:
label names sorted, counters as ``_total`` plus a ``_created`` gauge, histograms as cumulative
``_bucket`` lines with ``le`` followed by ``_count``, ``_sum`` and ``_created``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, cast

from prometheus_client import utils

# prometheus_client's exposition spelling of floats ("1e+06", "+Inf"), which it leaves untyped.
_go_float = cast(Callable[[float], str], utils.floatToGoString)


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _label_text(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(labels.items()))


class _Child:
    def __init__(self, family: _Family[Any], labels: dict[str, str]) -> None:
        self.family = family
        self.labels = labels
        self.value = 0.0
        self.created = time.time()


class GaugeChild(_Child):
    def set(self, value: float) -> None:
        value = float(value)
        if value != self.value:
            self.value = value
            self.family.changed()


class CounterChild(_Child):
    def inc(self, amount: float = 1.0) -> None:
        if amount:
            self.value += amount
            self.family.changed()


class HistogramChild(_Child):
    def __init__(self, family: _Family[Any], labels: dict[str, str]) -> None:
        super().__init__(family, labels)
        self.bounds: list[float] = family.bounds  # type: ignore[attr-defined]
        self.counts = [0] * (len(self.bounds) + 1)  # the last slot is +Inf
        # Label text of each bucket line, computed once: most of a histogram's render cost.
        les = [_go_float(b) for b in self.bounds] + ["+Inf"]
        self.bucket_labels = [_label_text({**labels, "le": le}) for le in les]

    def observe(self, value: float) -> None:
        # Prometheus buckets are "le": a value equal to a bound falls in that bound's bucket.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.value += value
        self.family.changed()


C = TypeVar("C", bound="_Child")
F = TypeVar("F", bound="_Family[Any]")


class _Family(Generic[C]):
    """One metric family: its children (one per label set) and its cached text."""

    child_type: type[C]

    def __init__(self, name: str, doc: str) -> None:
        self.name = name
        self.doc = doc.replace("\\", r"\\").replace("\n", r"\n")
        self.children: dict[str, C] = {}
        self._text: str | None = None

    def labels(self, **labels: str) -> C:
        key = _label_text(labels)
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = self.child_type(self, labels)
            self.changed()
        return child

    def text(self) -> str:
        if self._text is None:
            self._text = self._render()
        return self._text

    def changed(self) -> None:
        self._text = None

    def _header(self, name: str, kind: str) -> str:
        return f"# HELP {name} {self.doc}\n# TYPE {name} {kind}\n"

    def _render(self) -> str:
        raise NotImplementedError


class Gauge(_Family[GaugeChild]):
    child_type = GaugeChild

    def _render(self) -> str:
        lines = (f"{self.name}{{{k}}} {_go_float(c.value)}\n" for k, c in self.children.items())
        return self._header(self.name, "gauge") + "".join(lines)


class Counter(_Family[CounterChild]):
    child_type = CounterChild

    def _render(self) -> str:
        total, created = f"{self.name}_total", f"{self.name}_created"
        items = self.children.items()
        return (
            self._header(total, "counter")
            + "".join(f"{total}{{{k}}} {_go_float(c.value)}\n" for k, c in items)
            + self._header(created, "gauge")
            + "".join(f"{created}{{{k}}} {_go_float(c.created)}\n" for k, c in items)
        )


class Histogram(_Family[HistogramChild]):
    child_type = HistogramChild

    def __init__(self, name: str, doc: str, buckets: Sequence[float]) -> None:
        super().__init__(name, doc)
        self.bounds = [float(b) for b in buckets]

    def _render(self) -> str:
        name, created = self.name, f"{self.name}_created"
        out = [self._header(name, "histogram")]
        for key, c in self.children.items():
            running = 0
            for labels, count in zip(c.bucket_labels, c.counts, strict=True):
                running += count
                out.append(f"{name}_bucket{{{labels}}} {_go_float(running)}\n")
            out.append(f"{name}_count{{{key}}} {_go_float(running)}\n")
            out.append(f"{name}_sum{{{key}}} {_go_float(c.value)}\n")
        out.append(self._header(created, "gauge"))
        out.extend(f"{created}{{{k}}} {_go_float(c.created)}\n" for k, c in self.children.items())
        return "".join(out)


class Registry:
    """The families of one replica's page, in registration order.

    Adding a family whose name is already registered returns the registered one: the engines
    of a data-parallel replica share one page, each family listing every engine's series."""

    def __init__(self) -> None:
        self.families: list[_Family[Any]] = []
        self._names: dict[str, _Family[Any]] = {}

    def add(self, family: F) -> F:
        known = self._names.get(family.name)
        if known is not None:
            return cast(F, known)
        self._names[family.name] = family
        self.families.append(family)
        return family

    def render(self) -> bytes:
        return "".join(f.text() for f in self.families).encode()
