"""Plugin interfaces of the scheduler: producers, filters, weighted scorers, a picker.

Plugins are small classes registered by name with :func:`register`; a profile (configured in
one YAML file) names plugins and weights, and :mod:`epp.scheduling.builder` turns it into a
:class:`Profile`. Per request a profile runs in four steps:

1. data: every :class:`Producer` computes what it declares in ``produces`` (prompt hashes,
   prefix matches per endpoint) once, for every candidate, in dependency order; then the
   framework computes derived keys (:mod:`epp.scheduling.data`);
2. filters, readiness first, then by their declared ``stage``;
3. scorers, summed with their weights in a fixed order;
4. the picker, then every :class:`PostPick` hook.

Filters, scorers and hooks only read the cycle's data, so a profile's list order cannot change
a result. What a plugin learns across requests lives in :class:`~epp.state.fleet.FleetState`,
reached through the cycle: plugin instances are rebuilt on every configuration reload.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, TypeVar

from epp.errors import RequestError
from epp.metrics.plugin_clock import Lap, PluginClock
from epp.request import InferenceRequest
from epp.roles import Role
from epp.scheduling.data import DataKey, Derived, Input
from epp.scheduling.params import NoParams, Params, param
from epp.state.fleet import FleetState
from epp.state.registry import StateKey
from epp.state.snapshot import EndpointState, Snapshot
from epp.wire import PREFILL, PREFILL_HEADERS

T = TypeVar("T")


@dataclass(slots=True)
class Cycle:
    """Per-request scheduling context.

    ``snapshot`` is the endpoint view used for the whole decision, ``fleet`` the long-lived
    routing state (in-flight work, prefix indexes, sessions, prefill backlog); the data step
    fills the typed per-request data read with :meth:`get`.
    """

    snapshot: Snapshot
    fleet: FleetState = field(default_factory=FleetState)
    # Relative endpoint capacity (configured; missing means 1.0).
    weights: Mapping[str, float] = field(default_factory=dict)
    now: float = field(default_factory=time.time)
    # Prefill/decode role of endpoints (epp.roles; missing means both).
    roles: Mapping[str, Role] = field(default_factory=dict)
    _data: dict[DataKey[Any], Any] = field(default_factory=dict)

    def get(self, key: DataKey[T]) -> T | None:
        """The request's ``key`` data, or None when no producer in the profile wrote it."""
        value: T | None = self._data.get(key)
        return value

    def put(self, key: DataKey[T], value: T) -> None:
        self._data[key] = value


class Plugin:
    """Base of every plugin.

    ``type_name`` is the registry name, ``name`` the configured one; ``params_type`` the frozen
    dataclass of its parameters (:mod:`epp.scheduling.params`), ``produces``/``consumes`` the
    per-request data it writes and reads (:mod:`epp.scheduling.data`); ``states`` the
    long-lived states it keeps in the fleet state (:mod:`epp.state.registry`), declared when
    its configuration is applied so that they exist (and replicate) before its first request.
    """

    type_name: ClassVar[str] = ""
    params_type: ClassVar[type[Params]] = NoParams
    produces: ClassVar[tuple[DataKey[Any], ...]] = ()
    consumes: ClassVar[tuple[Input, ...]] = ()
    name: str = ""
    states: tuple[StateKey[Any], ...] = ()

    def __init__(self, params: Any = None) -> None:
        """Plugins with parameters override this and take an instance of ``params_type``."""


class Producer(Plugin):
    """Computes per-request data for the other plugins, before any filter runs."""

    @abc.abstractmethod
    def produce(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> None: ...


class Filter(Plugin):
    """Removes candidates that must not serve the request.

    ``stage`` orders filters (lowest first, then by name): a filter that keeps every candidate
    when none would qualify gives a different result before or after another filter, so the
    order is the framework's, not the profile's.
    """

    stage: ClassVar[int] = 100

    @abc.abstractmethod
    def filter(
        self, request: InferenceRequest, candidates: list[EndpointState], cycle: Cycle
    ) -> list[EndpointState]: ...

    def refusal(self, request: InferenceRequest, cycle: Cycle) -> RequestError | None:
        """The error to answer when this filter removed every candidate (None: the router's
        "no endpoint is ready" 503)."""
        return None


class Scorer(Plugin):
    """Scores each candidate in [0, 1]; higher is better. Weights are applied by the profile."""

    @abc.abstractmethod
    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> Sequence[float]: ...


class Picker(Plugin):
    """Chooses up to ``count`` endpoints, best first, from candidates and their total scores."""

    @abc.abstractmethod
    def pick(
        self, candidates: Sequence[EndpointState], totals: Sequence[float], count: int
    ) -> list[EndpointState]: ...


class Prepare(Plugin):
    """Work a plugin may have to wait for (tokenizing a long new prompt), done before the
    decision so that scoring itself never waits. Only profiles with such a plugin pay for the
    extra step; a plugin that is already ready returns at once."""

    @abc.abstractmethod
    async def prepare(self, request: InferenceRequest, fleet: FleetState) -> None: ...


class PostPick(Plugin):
    """Told about every pick (after the decision), to update what scoring remembers."""

    @abc.abstractmethod
    def on_pick(self, request: InferenceRequest, endpoint: EndpointState, cycle: Cycle) -> None: ...


@dataclass(frozen=True, slots=True)
class DeciderParams(Params):
    """``prefill_profile``: the profile that picks the prefill replica; ``header``: the
    request header naming it to the decode replica's sidecar."""

    prefill_profile: str = "prefill"
    header: str = param(PREFILL, choices=PREFILL_HEADERS)


class Decider(Plugin):
    """Decides, once the decode replica is picked, whether a request is disaggregated: its
    prefill run on a replica the ``prefill_profile`` picks, the KV handed to the decode one
    (docs/pd.md). The answer names that replica in ``header``."""

    params_type: ClassVar[type[Params]] = DeciderParams

    def __init__(self, params: DeciderParams = DeciderParams()) -> None:
        self.prefill_profile = params.prefill_profile
        self.header = params.header

    @abc.abstractmethod
    def disaggregate(
        self, request: InferenceRequest, decode: EndpointState, uncached: int, cycle: Cycle
    ) -> bool:
        """Whether to prefill elsewhere, given the prompt tokens ``decode`` does not cache."""


C = TypeVar("C", bound=type[Plugin])
_REGISTRY: dict[str, type[Plugin]] = {}


def register(type_name: str, *aliases: str) -> Callable[[C], C]:
    """Class decorator: make a plugin constructible by ``type_name`` (and aliases) from config."""

    def decorate(cls: C) -> C:
        cls.type_name = type_name
        for key in (type_name, *aliases):
            if key in _REGISTRY:
                raise ValueError(f"plugin type '{key}' registered twice")
            _REGISTRY[key] = cls
        return cls

    return decorate


def plugin_types() -> list[str]:
    return sorted(_REGISTRY)


def plugin_class(type_name: str) -> type[Plugin] | None:
    return _REGISTRY.get(type_name)


def producers_of(key: DataKey[Any]) -> list[str]:
    """Registered plugin types (not aliases) that produce ``key``."""
    return sorted({cls.type_name for cls in _REGISTRY.values() if key in cls.produces})


def create_plugin(type_name: str, name: str, params: Params | None = None) -> Plugin:
    """Instantiate a registered plugin with its parameters (defaults when None)."""
    cls = _REGISTRY[type_name]
    plugin = cls(params if params is not None else cls.params_type())
    plugin.name = name
    return plugin


@dataclass(frozen=True, slots=True)
class Decision:
    """The endpoints chosen, best first (later ones are fallbacks), with scores to explain why."""

    endpoints: list[EndpointState]
    # endpoint -> {scorer name: weighted score, "total": sum}; filled only when asked to explain.
    scores: dict[str, dict[str, float]] | None = None
    # Why there are no endpoints: the filter's own error, when it has one.
    refusal: RequestError | None = None
    # Disaggregated: the replica that runs the prefill, and the header naming it.
    prefill: EndpointState | None = None
    prefill_header: str = ""
    # The prompt tokens the prefill replica does not cache: its prefill leg's work.
    prefill_tokens: int = 0
    # Why it was (not) disaggregated; filled only when asked to explain.
    disaggregation: dict[str, Any] | None = None


@dataclass(slots=True)
class Profile:
    """A named pipeline, in execution order (:mod:`epp.scheduling.builder` orders it).

    Built once per configuration, run once per request: construction pairs every plugin with
    the list its durations go to, so a run is flat loops over those pairs with one clock read
    per plugin (the plugins stay separate registered types; only their timing is bound here).
    """

    name: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker
    post_pick: list[PostPick] = field(default_factory=list)
    prepare: list[Prepare] = field(default_factory=list)
    producers: list[Producer] = field(default_factory=list)
    decider: Decider | None = None
    derived: list[Derived[Any]] = field(default_factory=list)
    clock: PluginClock = field(init=False)
    _producers: list[tuple[Producer, list[float]]] = field(init=False)
    _filters: list[tuple[Filter, list[float]]] = field(init=False)
    _scorers: list[tuple[Scorer, float, list[float]]] = field(init=False)
    _picker: list[float] = field(init=False)
    _post_pick: list[tuple[PostPick, list[float]]] = field(init=False)

    def __post_init__(self) -> None:
        clock = self.clock = PluginClock(
            [
                *(("producer", p) for p in self.producers),
                *(("filter", f) for f in self.filters),
                *(("scorer", s) for s, _ in self.scorers),
                ("picker", self.picker),
                *(("post_pick", h) for h in self.post_pick),
            ]
        )
        self._producers = [(p, clock.sink("producer", p)) for p in self.producers]
        self._filters = [(f, clock.sink("filter", f)) for f in self.filters]
        self._scorers = [(s, w, clock.sink("scorer", s)) for s, w in self.scorers]
        self._picker = clock.sink("picker", self.picker)
        self._post_pick = [(h, clock.sink("post_pick", h)) for h in self.post_pick]

    def declare(self, fleet: FleetState) -> None:
        """Create the long-lived states this profile's plugins keep (applying a configuration)."""
        plugins: list[Plugin] = [
            *self.producers,
            *self.filters,
            *(s for s, _ in self.scorers),
            self.picker,
            *self.post_pick,
            *self.prepare,
            *([self.decider] if self.decider is not None else []),
        ]
        for plugin in plugins:
            for key in plugin.states:
                fleet.states.get(key)

    def produce(
        self,
        request: InferenceRequest,
        candidates: Sequence[EndpointState],
        cycle: Cycle,
        laps: list[Lap] | None = None,
    ) -> None:
        """The data step: every producer once, in dependency order, then derived keys."""
        now = time.perf_counter
        last = now()
        for producer, sink in self._producers:
            producer.produce(request, candidates, cycle)
            end = now()
            sink.append(end - last)
            if laps is not None:
                laps.append(("producer", producer, last, end))
            last = end
        for rule in self.derived:
            cycle.put(rule.key, rule.compute(cycle))

    def run(
        self,
        request: InferenceRequest,
        candidates: list[EndpointState],
        cycle: Cycle,
        count: int,
        explain: bool = False,
        laps: list[Lap] | None = None,
        defer: list[Callable[[], None]] | None = None,
    ) -> Decision:
        """Choose up to ``count`` endpoints. The post-pick hooks run before returning, or, with
        ``defer``, are appended to it as one task for the caller to run once its answer is out
        (they only update what later decisions read). ``laps`` (a traced request's) receives
        each plugin's start and end, the deferred hooks' included. Each plugin's share is the
        time since the previous one ended (the derived keys' work belongs to none)."""
        now = time.perf_counter
        started = now()
        self.produce(request, candidates, cycle, laps)
        last = now()
        for f, sink in self._filters:
            candidates = f.filter(request, candidates, cycle)
            end = now()
            sink.append(end - last)
            if laps is not None:
                laps.append(("filter", f, last, end))
            last = end
            if not candidates:
                self.clock.stop(started)
                why = {"filtered-out-by": {f.name: 0.0}} if explain else None
                return Decision([], why, f.refusal(request, cycle))
        totals = [0.0] * len(candidates)
        breakdown: dict[str, dict[str, float]] | None = (
            {c.address: {} for c in candidates} if explain else None
        )
        for scorer, weight, sink in self._scorers:
            scores = scorer.score(request, candidates, cycle)
            totals = [t + weight * s for t, s in zip(totals, scores, strict=True)]
            if breakdown is not None:
                for c, s in zip(candidates, scores, strict=True):
                    breakdown[c.address][scorer.name] = round(weight * s, 4)
            end = now()
            sink.append(end - last)
            if laps is not None:
                laps.append(("scorer", scorer, last, end))
            last = end
        if breakdown is not None:
            for c, t in zip(candidates, totals, strict=True):
                breakdown[c.address]["total"] = round(t, 4)
        chosen = self.picker.pick(candidates, totals, count)
        end = now()
        self._picker.append(end - last)
        if laps is not None:
            laps.append(("picker", self.picker, last, end))
        if chosen and self._post_pick:
            if defer is None:
                self._run_post_pick(request, chosen[0], cycle, laps)
            else:
                defer.append(partial(self._run_post_pick, request, chosen[0], cycle, laps))
        self.clock.stop(started)
        return Decision(chosen, breakdown)

    def _run_post_pick(
        self,
        request: InferenceRequest,
        chosen: EndpointState,
        cycle: Cycle,
        laps: list[Lap] | None,
    ) -> None:
        # Deferred, other runs may have happened since: timed from here, the laps going to the
        # trace of the run that picked.
        now = time.perf_counter
        last = now()
        for hook, sink in self._post_pick:
            hook.on_pick(request, chosen, cycle)
            end = now()
            sink.append(end - last)
            if laps is not None:
                laps.append(("post_pick", hook, last, end))
            last = end
